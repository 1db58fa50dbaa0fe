"""The in-process container's host cache with an accelerator: views of one exactly sized,
registered buffer, bitwise equal to torch AdamW, through checkpoints; on CPU (nothing to
pin) one tensor per moment and one step vector. The accelerator path runs here on a CPU backend that
claims pinned memory (:class:`test_host_register.PinnedCPU`)."""

from __future__ import annotations

import functools
import gc
import io
from typing import Any

import pytest
import torch
from _swap_testing import assert_matches_reference, swap_and_reference, train
from test_host_register import PinnedCPU

from swap_state.client.device import PAGE_SIZE, DeviceBackend
from swap_state.client.optim.host_cache import FLAT_ALIGN, FLAT_PAGE_RUN, flat_layout, steps_vector
from swap_state.client.swap_optimizer import STEP_KEY, SwapOptimizersContainer

KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": True}
PIPELINES = [pytest.param(False, id="inplace"), pytest.param(True, id="pipelined")]


def test_flat_layout_aligns_each_tensor() -> None:
    big = FLAT_PAGE_RUN * PAGE_SIZE
    offsets, total = flat_layout([4, 600, big, 8, big + 1, 4])
    assert offsets == [0, FLAT_ALIGN, PAGE_SIZE, PAGE_SIZE + big, 2 * PAGE_SIZE + big, 2 * PAGE_SIZE + 2 * big + FLAT_ALIGN]
    assert total == offsets[-1] + 4
    assert flat_layout([]) == ([], 0)


def _flat(pipeline: bool, backend: DeviceBackend) -> tuple[Any, Any, Any, Any]:
    container_cls = functools.partial(SwapOptimizersContainer, device_backend=backend)
    return swap_and_reference(torch.optim.AdamW, KWARGS, pipeline=pipeline, container_cls=container_cls)  # type: ignore[arg-type]


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_moments_are_views_of_one_registered_buffer_and_match_torch(pipeline: bool) -> None:
    backend = PinnedCPU(chunk_bytes=PAGE_SIZE)
    container, model, ref, ref_model = _flat(pipeline, backend)
    hosts = list(container.param_to_cpu_states_map.values())
    tensors = [t for host in hosts for t in host.values() if t is not None]
    (storage_ptr,) = {t.untyped_storage().data_ptr() for t in tensors}
    (registration,) = backend.registered_ranges()
    assert registration.ptr == storage_ptr
    moments = [t for host in hosts for k, t in host.items() if t is not None and k != STEP_KEY]
    # Sized exactly: every moment's bytes, each on FLAT_ALIGN, and one vector of steps.
    assert all(t.data_ptr() % FLAT_ALIGN == 0 for t in moments)
    used = sum(t.nbytes for t in tensors)
    assert used <= registration.nbytes <= -(-(used + len(tensors) * FLAT_ALIGN) // PAGE_SIZE) * PAGE_SIZE
    steps = [host[STEP_KEY] for host in hosts]
    assert [s.data_ptr() - steps[0].data_ptr() for s in steps] == [4 * i for i in range(len(steps))]
    train(model, container, range(6))
    train(ref_model, ref, range(6))
    assert_matches_reference(container, model, ref, ref_model)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_checkpoint_round_trip_between_flat_caches(pipeline: bool) -> None:
    backend = PinnedCPU()
    container, model, ref, ref_model = _flat(pipeline, backend)
    train(model, container, range(4))
    buffer = io.BytesIO()
    torch.save(container.state_dict(), buffer)
    buffer.seek(0)
    # A second container (its own flat buffer) loads the checkpoint and carries on.
    resumed, fresh, _, _ = _flat(pipeline, backend)
    fresh.load_state_dict(model.state_dict())
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    train(fresh, resumed, range(4, 8))
    train(ref_model, ref, range(8))
    assert_matches_reference(resumed, fresh, ref, ref_model)
    assert len(backend.registered_ranges()) == 2
    del container, model, resumed, fresh
    gc.collect()
    assert backend.registered_ranges() == []  # the last view gone: unregistered


def test_cpu_keeps_one_unpinned_tensor_per_moment_and_one_step_vector() -> None:
    backend = DeviceBackend("cpu")
    container = _flat(False, backend)[0]
    hosts = list(container.param_to_cpu_states_map.values())
    tensors = [t for host in hosts for key, t in host.items() if t is not None and key != STEP_KEY]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    assert not any(t.is_pinned() for t in tensors) and backend.registered_ranges() == []
    steps = [host[STEP_KEY] for host in hosts]  # update order: consecutive elements of one vector
    assert steps_vector(steps) is not None and steps_vector(steps).numel() == len(hosts)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flat_buffer_is_pinned_exact_and_released() -> None:
    backend = DeviceBackend("cuda")
    nbytes = 3 * PAGE_SIZE + 100
    buffer = backend.alloc_host_bytes(nbytes, [(0, 2 * PAGE_SIZE), (2 * PAGE_SIZE, PAGE_SIZE + 100)])
    assert buffer.numel() == nbytes and buffer.is_pinned()
    buffer.fill_(5)
    on_device = buffer.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(on_device.sum()) == 5 * nbytes
    assert [r.ptr for r in backend.registered_ranges()] == [buffer.data_ptr()]
    del buffer
    gc.collect()
    assert backend.registered_ranges() == []
