"""The model's part of a whole-state snapshot: its parameters and persistent buffers, copied
into the trainer's segment when a snapshot of step N is asked for, so that the snapshot holds
the whole training state of step N (protocol step 5 of :mod:`swap_state.common.segment`).
Steps without a snapshot copy nothing.

The model tensors are the segment's last tensors, ``model.<fqn>`` under the model
state-dict fqn (what torchtitan's ``ModelWrapper`` and DCP use), one per distinct tensor: tied
weights are stored once, their other keys recorded as aliases. A DTensor keeps its local
shard, with its global shape and offset in the manifest.

The state dict is read by ``state_dict_of`` (torch's ``get_model_state_dict`` by default, what
torchtitan 0.2 checkpoints; torchtitan 0.3 checkpoints ``module.state_dict()``). An entry that
is not a live parameter or buffer is *derived*: a module's state-dict hook made it (torchtitan
0.3's llama3 splits its fused ``wqkv`` into ``wq``/``wk``/``wv`` on save). The segment keeps the
derived form, as the checkpoint does; before each copy it is made again from the module, and a
restore loads it back through the module's ``load_state_dict`` (whose hook merges it).

Call order (the remote container does this)::

    tensors = plan_model_tensors(model_parts, optimizer_params)   # before the Allocate
    area = ModelArea(tensors, views, guard, header, backend)      # after it
    per step:  area.wait_copy()             # before the step's first update
               ... update, commit step N ...
    snapshot:  area.copy_from_model(N)      # protect (copy-before-write), start the copy
               ... the Snapshot call ...    # returns while the copy runs
    restore:   ... the server restores the segment ...
               area.copy_into_model(R)      # the snapshot's parameters into the model

Between the commit of step N and the update of step N + 1 the parameters do not change: on an
accelerator the copy runs on a side stream, on the CPU on a helper thread, overlapped with the
next forward and backward, and the next update waits only for it; ``MODEL_STEP`` is published
from the helper thread once the copy has landed. The helper thread sets the trainer's device
first (:meth:`DeviceBackend.set_device`) and waits on a blocking event, so its wait sleeps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from swap_state.client.device import DeviceBackend
from swap_state.client.optim.dtensor_utils import global_layout, unwrap_dtensor
from swap_state.client.remote.segment_mapping import dtype_name
from swap_state.client.remote.snapshot_guard import SnapshotGuard
from swap_state.common.names import model_tensor_name
from swap_state.common.segment import Word
from swap_state.common.trainer_header import TrainerHeader
from swap_state.common.snapshot_metadata import TensorMetadata

__all__ = ["ModelArea", "ModelTensor", "StateDictOf", "plan_model_tensors", "model_state_bytes"]

#: Reads a model part's checkpoint form (fqn -> tensor).
StateDictOf = Callable[[nn.Module], dict[str, Any]]

log = logging.getLogger("swap_state.client.remote_container")


@dataclasses.dataclass(frozen=True, eq=False)
class ModelTensor:
    """One distinct tensor of the model's state dict, as the segment keeps it."""

    fqn: str
    """Its first key in the model state dict."""
    aliases: tuple[str, ...]
    """Its other keys there (tied weights), possibly none."""
    key: str
    """``"param"`` or ``"buffer"`` (the manifest's key)."""
    source: torch.Tensor
    """The live parameter or buffer (a DTensor or a plain tensor); for a derived entry, the
    tensor the last refresh wrote (its storage is kept)."""
    part: int = 0
    """The index of its model part."""
    derived: bool = False
    """Made by a state-dict hook, not a live tensor (see the module docstring)."""

    @property
    def name(self) -> str:
        return model_tensor_name(self.fqn)

    @property
    def local(self) -> torch.Tensor:
        return unwrap_dtensor(self.source)

    def spec(self) -> tuple[str, str, list[int]]:
        local = self.local
        return (self.name, dtype_name(local.dtype), list(local.shape))


def _identity(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    local = unwrap_dtensor(tensor)
    return (local.data_ptr(), tuple(local.shape), local.dtype)


def plan_model_tensors(
    model_parts: Sequence[nn.Module],
    params: Iterable[torch.Tensor] = (),
    state_dict_of: StateDictOf | None = None,
) -> list[ModelTensor]:
    """The distinct tensors of every model part's state dict (``state_dict_of``, default
    ``get_model_state_dict``: the fqns DCP and torchtitan checkpoint under), in state-dict order.

    ``params``: the optimizer's parameter objects, preferred as the live source of a tensor
    they share storage with (the state dict's values are detached views). A non-tensor entry
    (``_extra_state``) cannot be snapshotted: ValueError naming it.
    """
    live: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[torch.Tensor, str]] = {}
    for part in model_parts:
        for _, buffer in part.named_buffers(remove_duplicate=False):
            live.setdefault(_identity(buffer), (buffer, "buffer"))
        for _, param in part.named_parameters(remove_duplicate=False):
            live[_identity(param)] = (param, "param")
    for param in params:
        live[_identity(param)] = (param, "param")
    planned: dict[tuple[int, tuple[int, ...], torch.dtype], list[Any]] = {}
    for index, part in enumerate(model_parts):
        for fqn, value in (state_dict_of or get_model_state_dict)(part).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"model state-dict entry {fqn!r} is a {type(value).__name__}, not a tensor: "
                    "a whole-state snapshot cannot hold it (use the 'full' checkpoint mode)"
                )
            ident = _identity(value)
            if ident in planned:
                planned[ident][1].append(fqn)
                continue
            source, key = live.get(ident, (value, None))
            # A derived entry comes from the module's parameters (the known hooks split them).
            planned[ident] = [fqn, [], key or "param", source, index, key is None]
    return [
        ModelTensor(fqn, tuple(aliases), key, source, part, derived)
        for fqn, aliases, key, source, part, derived in planned.values()
    ]


def model_state_bytes(model_parts: Sequence[nn.Module], state_dict_of: StateDictOf | None = None) -> int:
    """Bytes the model tensors take in a segment, a page of slack each (for sizing)."""
    return sum(t.local.numel() * t.local.element_size() + 4096 for t in plan_model_tensors(model_parts, (), state_dict_of))


class ModelArea:
    """The model tensors of one mapped segment; owned by the remote container."""

    def __init__(
        self,
        tensors: Sequence[ModelTensor],
        views: Mapping[str, torch.Tensor],
        guard: SnapshotGuard,
        header: TrainerHeader,
        backend: DeviceBackend,
        *,
        model_parts: Sequence[nn.Module] = (),
        state_dict_of: StateDictOf | None = None,
    ):
        self.tensors = list(tensors)
        self._derived = _DerivedTensors(self.tensors, model_parts, state_dict_of)
        self._views = [views[t.name] for t in self.tensors]
        self._names = [t.name for t in self.tensors]
        self._guard = guard
        self._header = header
        self._backend = backend
        self.copied_step: int | None = None
        """The step whose parameters the last copy took (issued; None: none since a load)."""
        self._stream: Any = None
        self._done: Any = None  # the event of the copy in flight (accelerators)
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._published: concurrent.futures.Future[None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self._views)

    def metadata(self) -> dict[str, TensorMetadata]:
        """The manifest entries of the model tensors: fqn, key, DTensor layout."""
        out = {}
        for tensor in self.tensors:
            shape, offset = global_layout(tensor.source) or (None, None)
            out[tensor.name] = TensorMetadata(tensor.fqn, tensor.key, shape, offset)
        return out

    def aliases(self) -> dict[str, str]:
        """Per alias key of a tied tensor, the fqn it is stored under."""
        return {alias: t.fqn for t in self.tensors for alias in t.aliases}

    def wait_copy(self) -> None:
        """Before the parameters change again (the next update): the copy must have read
        them. On an accelerator the current stream waits for the copy's event (the host does
        not); on the CPU the host waits for the helper thread's copy."""
        if not self._backend.is_accelerator:
            self.wait_published()
        if self._done is not None:
            self._backend.current_stream().wait_event(self._done)
            self._done = None

    def copy_from_model(self, step: int) -> None:
        """Start copying the parameters and buffers of committed step ``step`` into the
        segment; ``MODEL_STEP = step + 1`` is published once the bytes are there. Call after
        the commit, right before the snapshot of ``step`` is asked for (protocol step 5)."""
        self.wait_published()
        self.wait_copy()
        header = self._header
        if header[Word.MODEL_STEP] > step:
            # A claim for this step or a later one the bytes do not hold (they are those of
            # before a load or restore): withdrawn until this copy has landed. Otherwise the
            # word stays: a snapshot waiting for it must not wait for this copy, which may
            # itself wait for that snapshot's writer to free a copy slot.
            header.withdraw_model()
        self._guard.protect(self._names)  # a persisting snapshot's bytes, copied first
        self.copied_step = step
        with torch.no_grad():  # optimizer.step() may run with grad on: no graph into the segment
            self._derived.refresh()
            self._copy_into_segment(step)

    def _copy_into_segment(self, step: int) -> None:
        """CPU: the helper thread copies, then publishes. Accelerator: copy on the side
        stream after the work queued so far; the helper thread publishes once the copy's
        event has completed."""
        header = self._header
        if self._publisher is None:
            # The helper thread works on this thread's device, not the default one (device 0
            # for every rank): set in the thread before its first task.
            self._publisher = concurrent.futures.ThreadPoolExecutor(
                1,
                thread_name_prefix="swap-state-model",
                initializer=self._backend.set_device,
                initargs=(self._backend.current_device(),),
            )
        if not self._backend.is_accelerator:
            self._published = self._publisher.submit(_copy_and_publish, self._views, self.tensors, header, step)
            return
        if self._stream is None:
            self._stream = self._backend.stream()
        self._stream.wait_stream(self._backend.current_stream())
        with self._backend.use_stream(self._stream):
            for view, tensor in zip(self._views, self.tensors):
                # Through the backend: where the segment's registration is not honoured as
                # pinned (probed on Ascend), the copy goes through its bounce ring, which takes
                # contiguous tensors (a buffer may not be; the copy is made on this stream).
                self._backend.copy_to_host(view, tensor.local.contiguous())
            # Blocking: the helper thread sleeps in its wait instead of spinning a core the
            # trainer's forward and backward want.
            done = self._backend.event(blocking=True)
            done.record(self._stream)
        self._done = done
        self._published = self._publisher.submit(_publish_when_done, done, header, step)

    def wait_published(self) -> None:
        """Block until the copy in flight has landed and ``MODEL_STEP`` says so."""
        published, self._published = self._published, None
        if published is not None:
            published.result()

    def copy_into_model(self, step: int) -> None:
        """After a restore: the segment's parameters and buffers (step ``step``'s) into the
        model, then ``MODEL_STEP = step + 1`` (the segment holds them already)."""
        self.wait_published()
        self.wait_copy()
        with torch.no_grad():
            for view, tensor in zip(self._views, self.tensors):
                local = tensor.local
                if local.is_contiguous():
                    self._backend.copy_to_device(local, view)  # the bounce ring where needed
                else:
                    local.copy_(view)  # a strided buffer: the ring takes contiguous tensors
        self._backend.synchronize()
        self._derived.load_into_model()  # on the current stream, after the copies above landed
        self.copied_step = step
        self._header.publish_model(step)

    def invalidate(self) -> None:
        """The model may be replaced (a checkpoint load): the next snapshot copies it first."""
        self.copied_step = None

    def close(self) -> None:
        """Before the segment is unmapped: no copy may still write into it."""
        try:
            self.wait_published()
        finally:
            if self._publisher is not None:
                self._publisher.shutdown(wait=True)
                self._publisher = None


def _copy_and_publish(views: Sequence[torch.Tensor], tensors: Sequence[ModelTensor],
                      header: TrainerHeader, step: int) -> None:
    """The CPU's copy (torch releases the GIL while it copies), then ``MODEL_STEP``."""
    with torch.no_grad():
        for view, tensor in zip(views, tensors):
            view.copy_(tensor.local)
    header.publish_model(step)


def _publish_when_done(done: Any, header: TrainerHeader, step: int) -> None:
    done.synchronize()
    header.publish_model(step)


class _DerivedTensors:
    """The derived model tensors of a :class:`ModelArea` (held by it): made again from their
    modules before each copy, loaded back through them after a restore."""

    def __init__(
        self, tensors: Sequence[ModelTensor], model_parts: Sequence[nn.Module], state_dict_of: StateDictOf | None
    ):
        self._by_part: dict[int, list[ModelTensor]] = {}
        for tensor in tensors:
            if tensor.derived:
                self._by_part.setdefault(tensor.part, []).append(tensor)
        self._parts = list(model_parts)
        self._state_dict_of = state_dict_of or get_model_state_dict
        if self._by_part and not self._parts:
            names = [t.fqn for ts in self._by_part.values() for t in ts][:5]
            raise ValueError(f"model tensors {names} are made by state-dict hooks: the model area needs their modules")

    def refresh(self) -> None:
        """Write each derived tensor's current value into its kept storage (on the trainer's
        thread, before the copy into the segment starts)."""
        for index, tensors in self._by_part.items():
            fresh = self._state_dict_of(self._parts[index])
            for tensor in tensors:
                tensor.source.copy_(fresh[tensor.fqn])

    def load_into_model(self) -> None:
        """After the restored bytes are in the derived tensors: the modules load them (their
        load hooks make the live parameters from them)."""
        for index, tensors in self._by_part.items():
            self._parts[index].load_state_dict({t.fqn: t.source for t in tensors}, strict=False)
