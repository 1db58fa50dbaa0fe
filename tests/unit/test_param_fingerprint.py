"""The parameter fingerprint: exact sample indices at every size, bit-exact samples, one
gather per device and dtype and one host copy per device, whatever the number of parameters."""

from __future__ import annotations

import pytest
import torch

from swap_state.client.remote.remote_segment import SAMPLES_PER_TENSOR, UNKNOWN, ParamFingerprint, sample_stride


def sample_indices(numel: int) -> list[int]:
    """The indices :func:`sample_stride` describes."""
    samples, stride = sample_stride(numel)
    return [i * stride for i in range(samples)]


@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 2**24, 2**24 + 1, 4096 * 4097, 14336 * 4096, 2**31 + 5, 2**40 + 7])
def test_sample_indices_are_exact_and_in_range(numel):
    picks = sample_indices(numel)
    assert len(picks) == min(numel, SAMPLES_PER_TENSOR)
    assert picks[0] == 0 and picks[-1] <= numel - 1
    assert picks == sorted(set(picks))  # distinct and increasing
    # evenly spread: the last sample is within one stride of the end
    if len(picks) > 1:
        assert numel - 1 - picks[-1] < picks[1] + SAMPLES_PER_TENSOR
    # float32 linspace, the old way, ends past these tensors (the reproduction)
    if numel in (4096 * 4097, 14336 * 4096):
        assert torch.linspace(0, numel - 1, 64).long()[-1].item() >= numel


def test_empty_and_single_element_parameters():
    assert sample_indices(0) == []
    assert sample_indices(1) == [0]
    fp = ParamFingerprint([torch.empty(0), torch.ones(1)])
    assert fp.compute() != UNKNOWN


def test_a_4096x4097_weight_is_fingerprinted_and_every_sampled_change_is_seen():
    """4096x4097 has 2^24 + 4096 elements: the old float32 indices raised IndexError here."""
    weight = torch.randn(4096, 4097)
    others = [torch.randn(7).bfloat16(), torch.randn(3, 5, dtype=torch.float64)]
    fp = ParamFingerprint([weight, *others])
    first = fp.compute()
    assert first == fp.compute() != UNKNOWN
    last = divmod(sample_indices(weight.numel())[-1], weight.shape[1])
    for tensor, index in ((weight, last), (weight, (0, 0)), (others[0], (6,)), (others[1], (2, 4))):
        before = tensor[index].clone()
        tensor[index] = before + 1
        assert fp.compute() != first, (tensor.shape, index)
        tensor[index] = before
        assert fp.compute() == first


def test_the_order_of_the_parameters_is_part_of_it():
    a, b = torch.randn(10), torch.randn(10)
    assert ParamFingerprint([a, b]).compute() != ParamFingerprint([b, a]).compute()


def test_one_gather_and_one_host_copy_per_device(monkeypatch):
    params = [torch.randn(100), torch.randn(3).half(), torch.randn(50, 2), torch.randn(7).half()]
    fp = ParamFingerprint(params)
    cats, copies = [], []
    real_cat, real_cpu = torch.cat, torch.Tensor.cpu
    monkeypatch.setattr(torch, "cat", lambda tensors, *a, **k: cats.append(len(tensors)) or real_cat(tensors, *a, **k))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.numel()) or real_cpu(self, *a, **k))
    fp.compute()
    # float32 (2 parameters) and float16 (2) gathered once each, then one buffer, one copy
    assert sorted(cats) == [2, 2, 2] and len(copies) == 1


def test_a_replaced_parameter_is_sampled_from_its_new_data():
    params = [torch.randn(100), torch.randn(10)]
    fp = ParamFingerprint(params)
    first = fp.compute()
    fp._params[0] = params[0].clone()  # same values elsewhere in memory: same fingerprint
    assert fp.compute() == first
    fp._params[0] = torch.randn(100)
    assert fp.compute() != first


def _reference_digest(params):
    """The digest computed from scratch: per dtype (by name), each parameter's samples in
    order, as raw bytes (CPU only)."""
    import hashlib

    by_dtype: dict[str, list[torch.Tensor]] = {}
    for p in params:
        flat = p.detach().reshape(-1)
        if flat.numel():
            by_dtype.setdefault(str(flat.dtype), []).append(flat[sample_indices(flat.numel())])
    data = b"".join(torch.cat(by_dtype[d]).view(torch.uint8).numpy().tobytes() for d in sorted(by_dtype))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


def test_the_digest_is_the_samples_bytes_and_follows_data_moved_under_the_same_parameter():
    params = [torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(9).half()), torch.nn.Parameter(torch.randn(33, 3))]
    fp = ParamFingerprint(params)
    assert fp.compute() == _reference_digest(params)
    with torch.no_grad():
        params[2].mul_(2)  # in place: the kept views see it
    assert fp.compute() == _reference_digest(params)
    params[0].data = torch.randn(100)  # the same Parameter, its data elsewhere
    assert fp.compute() == _reference_digest(params)
    params[1].data = params[1].data.float()  # another dtype: regrouped
    assert fp.compute() == _reference_digest(params)


def test_a_dtensor_whose_local_shard_is_swapped_is_sampled_from_the_new_shard(cpu_mesh):
    from torch.distributed.tensor import DTensor, Replicate

    local = torch.randn(40)
    param = DTensor.from_local(local, cpu_mesh, [Replicate()], run_check=False)
    plain = torch.randn(5)
    fp = ParamFingerprint([param, plain])
    assert fp.compute() == _reference_digest([local, plain])
    swapped = torch.randn(40)
    param._local_tensor = swapped  # what FSDP does when it resets a sharded parameter
    assert fp.compute() == _reference_digest([swapped, plain])
