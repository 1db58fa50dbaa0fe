"""The parameter fingerprint: exact sample indices at every size, bit-exact samples, one
buffer and one host copy per device, whatever the number of parameters."""

from __future__ import annotations

import pytest
import torch

from swap_state.client.remote.fingerprint import SAMPLES_PER_TENSOR, UNKNOWN, ParamFingerprint, sample_indices


@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 2**24, 2**24 + 1, 4096 * 4097, 14336 * 4096, 2**31 + 5, 2**40 + 7])
def test_sample_indices_are_exact_and_in_range(numel):
    picks = sample_indices(numel)
    assert len(picks) == min(numel, SAMPLES_PER_TENSOR)
    assert picks[0] == 0 and picks[-1] == numel - 1
    assert picks == sorted(set(picks))  # distinct and increasing
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
    for tensor, index in ((weight, (-1, -1)), (weight, (0, 0)), (others[0], (6,)), (others[1], (2, 4))):
        before = tensor[index].clone()
        tensor[index] = before + 1
        assert fp.compute() != first, (tensor.shape, index)
        tensor[index] = before
        assert fp.compute() == first


def test_the_order_of_the_parameters_is_part_of_it():
    a, b = torch.randn(10), torch.randn(10)
    assert ParamFingerprint([a, b]).compute() != ParamFingerprint([b, a]).compute()


def test_one_buffer_per_device_and_a_changed_parameter_is_planned_again():
    params = [torch.randn(100), torch.randn(3).half(), torch.randn(50, 2)]
    fp = ParamFingerprint(params)
    fp.compute()
    (plan,) = fp._plans.values()
    buffer = plan.buffer
    assert [index for index, *_ in plan.runs] == [0, 1, 2]
    assert all(start % 8 == 0 for *_, start in plan.runs)  # each run can be viewed as its dtype
    fp.compute()
    assert fp._plans[torch.device("cpu")].buffer is buffer  # planned once
    params[1] = torch.randn(9).half()
    fp._params[1] = params[1]
    fp.compute()
    assert fp._plans[torch.device("cpu")].buffer is not buffer
