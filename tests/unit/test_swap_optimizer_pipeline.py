"""The pipelined step's slicing, stream/event protocol, hooks and buffer lifetime, on CPU.

A recording backend stands in for an accelerator: its streams and events log what the
container asks of them, and ``record_stream`` keeps weak references to every device
buffer, so the tests can check ordering and that buffers die after their offload.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
from _swap_testing import apply_grads, make_grads

from swap_state.client.optim.kernels import plan_slices
from swap_state.client.device import DeviceBackend
from swap_state.client.optim.container import SwapOptimizersContainer
from swap_state.client.optim.moment_store import PinnedHostMemory


class _Event:
    def __init__(self, log: list[tuple[Any, ...]], number: int) -> None:
        self.log, self.number, self.stream = log, number, None

    def record(self, stream: Any = None) -> None:
        self.stream = stream.name
        self.log.append(("record", stream.name, self.number))

    def synchronize(self) -> None:
        self.log.append(("host_wait", self.stream, self.number))


class _Stream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait", self.name, event.number))

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class RecordingBackend(DeviceBackend):
    """A CPU backend whose streams and events log every call."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.log: list[tuple[Any, ...]] = []
        self.buffers: list[weakref.ref[torch.Tensor]] = []
        self._names = iter(["load", "offload"])
        self._numbers = itertools.count()
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute
        self.copies: list[tuple[str, str, int, int]] = []  # (direction, stream, host ptr, numel)

    def stream(self) -> _Stream:
        return _Stream(self.log, next(self._names))

    def current_stream(self) -> _Stream:
        return self.current

    def event(self) -> _Event:
        return _Event(self.log, next(self._numbers))

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        previous, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield stream
        finally:
            self.current = previous
            self.log.append(("exit", stream.name))

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("record_stream", stream.name))
        self.buffers.append(weakref.ref(tensor))

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append(("to_device", self.current.name, src.data_ptr(), src.numel()))
        super().copy_to_device(dst, src)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append(("to_host", self.current.name, dst.data_ptr(), dst.numel()))
        super().copy_to_host(dst, src)


class RecordingStore(PinnedHostMemory):
    """Logs the store's calls into the backend's log and checks the host bytes are still old."""

    def __init__(self, backend: RecordingBackend):
        super().__init__(backend)
        self.log = backend.log
        self.names: dict[torch.Tensor, str] = {}
        self.expected_host: dict[torch.Tensor, torch.Tensor] = {}
        self.caches: dict[torch.Tensor, Any] = {}

    def before_write(self, params: Sequence[torch.Tensor]) -> None:
        self.log.append(("before_host_write", tuple(self.names[p] for p in params)))
        for param in params:
            expected = self.expected_host.get(param)
            if expected is not None:
                assert torch.equal(self.caches[param]["exp_avg"], expected), "host written before hook"

    def after_step(self) -> None:
        self.log.append(("after_step",))


def log_updates(container: SwapOptimizersContainer, store: RecordingStore) -> None:
    """Log each fused update of the container's step pipeline (its part that runs them)."""
    steps = container._steps
    fused_update = steps._fused_update

    def logged(optim: Any, work: Any, states: Any) -> None:
        store.log.append(("update", tuple(store.names[p] for p in work.params)))
        fused_update(optim, work, states)

    steps._fused_update = logged  # type: ignore[method-assign]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(6)])


def _container(pipeline: bool, times: int = 3) -> tuple[SwapOptimizersContainer, nn.Module, RecordingBackend]:
    backend = RecordingBackend()
    store = RecordingStore(backend)
    model = _model()
    container = SwapOptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-2}, times, device_backend=backend, pipeline=pipeline, store=store
    )
    store.names = {p: n for n, p in model.named_parameters()}
    store.caches = container.param_to_cpu_states_map
    log_updates(container, store)
    return container, model, backend


def _step(container: SwapOptimizersContainer, model: nn.Module, step: int) -> None:
    apply_grads(model, make_grads(model, step))
    container.store.expected_host = {  # type: ignore[attr-defined]
        p: container.param_to_cpu_states_map[p]["exp_avg"].clone() for p in model.parameters()
    }
    container.step()


def test_plan_slices_balances_bytes_and_keeps_order() -> None:
    assert plan_slices([1] * 16, 4) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert plan_slices([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert plan_slices([5, 5], 8) == [range(0, 1), range(1, 2)]
    assert plan_slices([0, 0], 3) == [range(0, 2)]
    # Real sizes, integer arithmetic: Llama-3-8B's layer moments (bytes) in 4 slices, and
    # sizes a float cannot hold exactly.
    layer = [14336 * 4096 * 4] * 3 + [4096 * 4096 * 4] * 4
    assert plan_slices(layer * 8, 4) == [range(i * 14, (i + 1) * 14) for i in range(4)]
    assert plan_slices([2**53 + 1, 2**53 + 1], 2) == [range(0, 1), range(1, 2)]
    assert plan_slices([], 3) == []
    with pytest.raises(ValueError):
        plan_slices([1], 0)


def test_pipelined_step_protocol() -> None:
    container, model, backend = _container(pipeline=True)
    _step(container, model, 0)
    log = backend.log
    slices = [("0.weight", "1.weight"), ("2.weight", "3.weight"), ("4.weight", "5.weight")]
    assert [entry[1] for entry in log if entry[0] == "before_host_write"] == slices
    loads = [e[2] for e in log if e[:2] == ("record", "load")]
    updates = [e[2] for e in log if e[:2] == ("record", "compute")]
    offloads = [e[2] for e in log if e[:2] == ("record", "offload")]
    assert len(loads) == len(updates) == len(offloads) == 3
    for k in range(3):
        update = log.index(("update", slices[k]))
        waited_load = log.index(("wait", "compute", loads[k]))
        assert (
            log.index(("record", "load", loads[k]))
            < waited_load
            < update
            < log.index(("record", "compute", updates[k]))
        )
        offload_wait = log.index(("wait", "offload", updates[k]))
        hook = log.index(("before_host_write", slices[k]))
        assert log.index(("record", "compute", updates[k])) < hook < offload_wait
        assert offload_wait < log.index(("record", "offload", offloads[k]))
        if k + 1 < 3:  # the next slice loads while this one updates, and before it offloads
            assert update < log.index(("record", "load", loads[k + 1])) < hook
        if k >= 1 and k + 1 < 3:
            # Bounded memory: the load of slice k+1 starts only once the host has seen the
            # offload of slice k-1 complete (after the update of slice k is enqueued).
            host_wait = log.index(("host_wait", "offload", offloads[k - 1]))
            assert update < host_wait and log[host_wait + 1] == ("enter", "load")
    assert [e for e in log if e[0] == "host_wait"] == [("host_wait", "offload", offloads[0])]
    assert log[-3:] == [("sync", "load"), ("sync", "offload"), ("after_step",)]
    assert log.count(("after_step",)) == 1
    # every device buffer is recorded on compute and offload, and freed after the step
    # exp_avg and exp_avg_sq of each parameter, and each slice's step vector (the steps are
    # consecutive elements of one host vector: one copy each way per slice)
    assert sum(1 for e in log if e == ("record_stream", "offload")) == 6 * 2 + 3
    assert backend.buffers and all(ref() is None for ref in backend.buffers)


def test_inplace_step_calls_hook_before_each_slice_update() -> None:
    container, model, backend = _container(pipeline=False, times=2)
    _step(container, model, 0)
    _step(container, model, 1)
    hooks = [e for e in backend.log if e[0] in ("before_host_write", "after_step")]
    first = ("before_host_write", ("0.weight", "1.weight", "2.weight"))
    second = ("before_host_write", ("3.weight", "4.weight", "5.weight"))
    assert hooks == [first, second, ("after_step",)] * 2
    assert not any(e[0] in ("record", "wait", "enter") for e in backend.log)


def test_params_without_grad_are_not_loaded_or_written() -> None:
    container, model, backend = _container(pipeline=True)
    apply_grads(model, make_grads(model, 0))
    model[2].weight.grad = None
    model[3].weight.grad = None
    before = {
        p: container.param_to_cpu_states_map[p]["exp_avg"].clone() for p in (model[2].weight, model[3].weight)
    }
    container.step()
    hooks = [e[1] for e in backend.log if e[0] == "before_host_write"]
    assert hooks == [("0.weight", "1.weight"), ("4.weight", "5.weight")]
    for param, old in before.items():
        assert torch.equal(container.param_to_cpu_states_map[param]["exp_avg"], old)


def test_inner_optimizer_step_outside_container_calls_after_step() -> None:
    container, model, backend = _container(pipeline=False)
    apply_grads(model, make_grads(model, 0))
    container.optimizers[0].step()
    assert backend.log.count(("after_step",)) == 1


def test_failed_validation_changes_nothing() -> None:
    container, model, backend = _container(pipeline=True)
    apply_grads(model, make_grads(model, 0))
    model[5].weight.grad = model[5].weight.grad.to_sparse()
    params_before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="sparse gradients"):
        container.step()
    assert float(container.optimizers[0].param_groups[0]["step"]) == 0.0
    assert all(torch.equal(p, old) for p, old in zip(model.parameters(), params_before, strict=True))
    assert not any(e[0] in ("before_host_write", "after_step", "record") for e in backend.log)


def test_pipelined_copies_go_through_the_backend() -> None:
    """Loads and offloads of moments and steps go through ``copy_to_device`` /
    ``copy_to_host`` (the bounce ring where registered host memory is not honoured as
    pinned), on the load and offload streams; every host byte of the cache moves each way."""
    container, model, backend = _container(pipeline=True)
    _step(container, model, 0)
    moved: dict[str, set[int]] = {"to_device": set(), "to_host": set()}
    for direction, stream, ptr, numel in backend.copies:
        assert stream == ("load" if direction == "to_device" else "offload")
        moved[direction] |= {ptr + 4 * i for i in range(numel)}  # float32 elements
    cache = [t for p in model.parameters() for t in container.param_to_cpu_states_map[p].values() if t is not None]
    expected = {t.data_ptr() + 4 * i for t in cache for i in range(t.numel())}
    assert moved == {"to_device": expected, "to_host": expected}
