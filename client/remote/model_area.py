"""The model's part of a whole-state snapshot: the segment's last tensors, ``model.<fqn>``, one
per distinct tensor (tied weights once), copied in when a snapshot of step N is asked for
(protocol step 5 of :mod:`swap_state.common.segment`). A *derived* entry (made by a state-dict
hook, e.g. torchtitan 0.3's llama3 splitting ``wqkv``) is made again before each copy and loaded
back through the module's ``load_state_dict``. Call order::

    tensors = plan_model_tensors(model_parts, optimizer_params)   # before the Allocate
    area = ModelArea(tensors, views, guard, header, backend)      # after it
    area.wait_copy()              # per step, before its first update
    area.copy_from_model(N)       # snapshot of committed step N: start the copy, then Snapshot
    area.copy_into_model(R)       # after the server restored the segment
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from swap_state.client.device import DeviceBackend
from swap_state.client.optim.dtensor_utils import global_layout, unwrap_dtensor
from swap_state.client.remote.segment_mapping import SegmentMapping, dtype_name
from swap_state.common.names import model_tensor_name
from swap_state.common.segment import Word
from swap_state.common.trainer_header import TrainerHeader
from swap_state.common.snapshot_metadata import TensorMetadata

__all__ = ["ModelArea", "ModelTensor", "StateDictOf", "plan_model_tensors", "model_state_bytes"]

#: Reads a model part's checkpoint form (fqn -> tensor).
StateDictOf = Callable[[nn.Module], dict[str, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelTensor:
    """One distinct tensor of the model's state dict, as the segment keeps it."""

    fqn: str  # its first key in the model state dict
    aliases: tuple[str, ...]  # its other keys (tied weights)
    key: str  # "param" or "buffer"
    source: torch.Tensor  # the live tensor; a derived entry's: what the last refresh wrote
    part: int = 0  # the index of its model part
    derived: bool = False  # made by a state-dict hook

    @property
    def name(self) -> str:
        return model_tensor_name(self.fqn)

    @property
    def local(self) -> torch.Tensor:
        return unwrap_dtensor(self.source)

    def spec(self) -> tuple[str, str, list[int]]:
        return (self.name, dtype_name(self.local.dtype), list(self.local.shape))


def _identity(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    local = unwrap_dtensor(tensor)
    return (local.data_ptr(), tuple(local.shape), local.dtype)


def plan_model_tensors(model_parts: Sequence[nn.Module], params: Iterable[torch.Tensor] = (),
                       state_dict_of: StateDictOf | None = None) -> list[ModelTensor]:
    """The distinct tensors of every model part's state dict, in its order. ``params`` (the
    optimizer's) are preferred as live sources; a non-tensor entry raises ValueError."""
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
                raise ValueError(f"model state-dict entry {fqn!r} is a {type(value).__name__}, not a tensor: "
                                 "a whole-state snapshot cannot hold it (use the 'full' checkpoint mode)")
            ident = _identity(value)
            if ident in planned:
                planned[ident][1].append(fqn)
                continue
            source, key = live.get(ident, (value, None))
            planned[ident] = [fqn, [], key or "param", source, index, key is None]
    return [ModelTensor(fqn, tuple(aliases), key, source, part, derived)
            for fqn, aliases, key, source, part, derived in planned.values()]


def model_state_bytes(model_parts: Sequence[nn.Module], state_dict_of: StateDictOf | None = None) -> int:
    """Bytes the model tensors take in a segment, a page of slack each (for sizing)."""
    return sum(t.local.nbytes + 4096 for t in plan_model_tensors(model_parts, (), state_dict_of))


class ModelArea:
    """The model tensors of one mapped segment; owned by the remote container."""

    def __init__(self, tensors: Sequence[ModelTensor], views: Mapping[str, torch.Tensor],
                 guard: SegmentMapping, header: TrainerHeader, backend: DeviceBackend, *,
                 model_parts: Sequence[nn.Module] = (), state_dict_of: StateDictOf | None = None):
        self.tensors = list(tensors)
        self._derived: dict[int, list[ModelTensor]] = {}  # by model part
        for tensor in self.tensors:
            if tensor.derived:
                self._derived.setdefault(tensor.part, []).append(tensor)
        self._parts = list(model_parts)
        self._state_dict_of = state_dict_of or get_model_state_dict
        if self._derived and not self._parts:
            names = [t.fqn for ts in self._derived.values() for t in ts][:5]
            raise ValueError(f"model tensors {names} are made by state-dict hooks: "
                             "the model area needs their modules")
        self._views = [views[t.name] for t in self.tensors]
        self._names = [t.name for t in self.tensors]
        self._guard = guard
        self._header = header
        self._backend = backend
        self.copied_step: int | None = None  # the step the last copy took (None: none since a load)
        self._stream: Any = None
        self._done: Any = None  # the event of the copy in flight (accelerators)
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._published: concurrent.futures.Future[None] | None = None

    def metadata(self) -> dict[str, TensorMetadata]:
        """The manifest entries of the model tensors: fqn, key, DTensor layout."""
        return {t.name: TensorMetadata(t.fqn, t.key, *(global_layout(t.source) or (None, None))) for t in self.tensors}

    def aliases(self) -> dict[str, str]:
        """Per alias key of a tied tensor, the fqn it is stored under."""
        return {alias: t.fqn for t in self.tensors for alias in t.aliases}

    def wait_copy(self) -> None:
        """Before the next update: the copy must have read the parameters (an accelerator's
        current stream waits for its event; on the CPU the host waits)."""
        if not self._backend.is_accelerator:
            self.wait_published()
        if self._done is not None:
            self._backend.current_stream().wait_event(self._done)
            self._done = None

    def copy_from_model(self, step: int) -> None:
        """Start copying committed ``step``'s parameters and buffers into the segment
        (``MODEL_STEP`` published once they land); right before its snapshot is asked for."""
        self.wait_published()
        self.wait_copy()
        header = self._header
        if header[Word.MODEL_STEP] > step:
            # A claim the bytes do not hold (from before a load or restore): withdrawn. Otherwise
            # it stays: a snapshot waiting on it must not wait for this copy (a slot deadlock).
            header.withdraw_model()
        self._guard.protect(self._names)  # a persisting snapshot's bytes, copied first
        self.copied_step = step
        with torch.no_grad():  # optimizer.step() may run with grad on: no graph into the segment
            for index, derived in self._derived.items():  # their current values, remade
                fresh = self._state_dict_of(self._parts[index])
                for tensor in derived:
                    tensor.source.copy_(fresh[tensor.fqn])
            self._copy_into_segment(step)

    def _copy_into_segment(self, step: int) -> None:
        """CPU: the helper thread copies and publishes; accelerator: a side-stream copy."""
        header = self._header
        if self._publisher is None:
            # The helper thread works on this thread's device, not device 0.
            self._publisher = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="swap-state-model", initializer=self._backend.set_device,
                initargs=(self._backend.current_device(),))
        if not self._backend.is_accelerator:
            self._published = self._publisher.submit(_copy_and_publish, self._views, self.tensors, header, step)
            return
        if self._stream is None:
            self._stream = self._backend.stream()
        self._stream.wait_stream(self._backend.current_stream())
        with self._backend.use_stream(self._stream):
            for view, tensor in zip(self._views, self.tensors):
                # Through the backend: its bounce ring (where the registration is not honoured as
                # pinned, probed on Ascend) takes contiguous tensors.
                self._backend.copy_to_host(view, tensor.local.contiguous())
            # Blocking: the helper thread sleeps instead of spinning a core the trainer wants.
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
        """After a restore: the segment's model tensors into the model, then ``MODEL_STEP``."""
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
        for index, derived in self._derived.items():  # their load hooks make the live parameters
            self._parts[index].load_state_dict({t.fqn: t.source for t in derived}, strict=False)
        self.copied_step = step
        self._header.publish_model(step)

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
