"""One trainer's segment on the server, from attach to detach (it knows no optimizer).

Call order::

    seg = RemoteSegment(config, model_parts, optimizer_kwargs)   # attach
    views = seg.allocate(specs, backend, params)   # map, claim; torn? resumed?
    seg.check_not_torn(); seg.mapping.before_write(step, names)   # per slice of a step
    seg.publish(step)                         # per step: fingerprint, end of write, commit
    seg.verify_kept_state()                   # first step after a reattach: keep or drop
    seg.snapshot(step, metadata_parts)        # between steps; -> SnapshotHandle
    seg.restore(snapshot_id, metadata, apply) # between steps; -> step
    seg.close(keep)

Reattach (same job id and rank within the server's ``--grace``): a nonzero ``WRITING_STEP``
means the previous trainer died mid-step (the state is *torn* until a restore or full load);
else kept moments are used only when the parameters' fingerprint matches the kept step's.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from swap_state.client.device import DeviceBackend, host_bytes
from swap_state.client.errors import (
    MetadataBaseUnknownError, ServerUnavailableError, SnapshotBusyError, SnapshotNotFoundError, SwapStateError)
from swap_state.client.optim.dtensor_utils import DTensor, unwrap_dtensor
from swap_state.client.remote.config import (
    RemoteConfig, connect, embedded_world_size_hint, snapshot_retention, snapshots_model)
from swap_state.client.remote.model_area import ModelArea, plan_model_tensors
from swap_state.client.remote.rpc import SnapshotHandle
from swap_state.client.remote.segment_mapping import SegmentMapping
from swap_state.common.errors import InvalidRequestError
from swap_state.common.names import parse_snapshot_id, snapshot_id_for
from swap_state.common.retry import wait_until
from swap_state.common.segment import Word
from swap_state.common.snapshot_metadata import BOOKKEEPING_PREFIX

__all__ = [
    "GROUP_STEPS", "PARAM_STEPS", "SAMPLES_PER_TENSOR", "UNKNOWN", "ParamFingerprint", "RemoteSegment", "sample_stride"]

log = logging.getLogger(__name__)

#: Segment tensors beside the moments: every parameter's step, every param group's step.
PARAM_STEPS = BOOKKEEPING_PREFIX + "param_steps"
GROUP_STEPS = BOOKKEEPING_PREFIX + "group_steps"


class RemoteSegment:
    """The attached session and its mapped segment (call order in the module docstring)."""

    def __init__(self, config: RemoteConfig, model_parts: Sequence[nn.Module], optimizer_kwargs: dict[str, Any]):
        """Attach (starting an embedded server when no address is configured)."""
        self.config = config
        self.model_parts = list(model_parts)
        self.client, self.session, self.embedded = connect(config, model_parts, optimizer_kwargs)
        self.mapping: SegmentMapping | None = None
        self.views: dict[str, torch.Tensor] = {}  # the segment's tensors by name, while mapped
        self.model_area: ModelArea | None = None  # the model's tensors (whole-state snapshots)
        self.torn_step: int | None = None  # the step the previous trainer died writing
        self.resumed_step: int | None = None  # the step a reattach (or a restore) resumed at
        self.snapshot_handle: SnapshotHandle | None = None  # the last snapshot taken (or restored)
        self.closed = False
        self._backend: DeviceBackend | None = None
        self._fingerprint: ParamFingerprint | None = None
        self._verify_pending = False  # kept state not yet checked against the parameters
        self._base_sent = False  # the server acknowledged the metadata base once
        self._location_logged = False

    def allocate(self, specs: Sequence[tuple[str, str, list[int]]], backend: DeviceBackend,
                 params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Allocate (with the model's tensors when snapshots hold them), map, register for DMA,
        claim the header; the views by name. ``params``: the optimizer's, which the fingerprint
        samples (a reattach's kept state is then to check against them)."""
        if self.mapping is not None:
            raise NotImplementedError("RemoteSwapOptimizersContainer allocates its segment once: every parameter "
                                      "and param group must exist when the container is built")
        model_tensors = (plan_model_tensors(self.model_parts, params, self.config.model_state_dict)
                         if snapshots_model(self.config) else [])
        reply = self.session.allocate([*specs, *(t.spec() for t in model_tensors)])  # last: protocol step 5
        self._backend = backend
        self.mapping = SegmentMapping.open(reply.segment)
        self.mapping.register_for_dma(backend)
        self.views = self.mapping.tensor_views()
        self.session.header = self.mapping.trainer
        self._claim(reply.reused)
        self.mapping.guard(self.config.backpressure_timeout_s, server_gone=self.session.server_gone)
        if model_tensors:
            self.model_area = ModelArea(model_tensors, self.views, self.mapping, self.mapping.trainer, backend,
                                        model_parts=self.model_parts, state_dict_of=self.config.model_state_dict)
        self._fingerprint = ParamFingerprint(list(params))
        self._verify_pending = self.resumed_step is not None
        return self.views

    def _claim(self, reused: bool) -> None:
        """Claim the header (a predecessor still running fails its next commit), then read what
        a kept segment holds: torn, resumable, or fresh."""
        header = self.mapping.header
        self.mapping.trainer.claim(self.session.generation)
        self.torn_step = None
        if reused and header[Word.WRITING_STEP] != 0:
            # The previous trainer died mid-step: some moments are of step S, some of S-1.
            self.torn_step = header[Word.WRITING_STEP] - 1
            log.warning("%s", self.torn_message())
        elif reused:
            # The kept step is the group steps' (written before the commit): a trainer killed
            # between its last write and its commit left a complete step, committed now.
            held = int(max(self.views[GROUP_STEPS].tolist(), default=0))
            committed = self.session.last_committed_step
            if held == 0 and committed is None:
                return  # nothing was ever written
            if held != committed:
                log.warning("the previous trainer wrote step %d completely but the server recorded step %d "
                            "(killed before its commit): resuming at step %d", held, committed, held)
                self.session.commit(held)
            self.resumed_step = held
            log.info("reattached to swap-state at step %d", held)
        elif getattr(self.session, "previous_session", ""):
            log.info("no swap-state optimizer state kept for this trainer: %s", self.session.previous_session)

    def torn_message(self) -> str:
        why = (f"a trainer died while writing step {self.torn_step}" if self.torn_step else
               "a restore or a load replacing the whole state did not finish")  # step 0: marked by those
        return (f"the kept optimizer state of {self.config.job_id}/rank {self.session.rank} is torn: {why}. "
                "Restore a snapshot (container.restore('latest')) or load a full checkpoint "
                "before stepping, or use a new job id")

    def check_not_torn(self) -> None:
        """Refuse to write into torn state: only a restore or a full load may."""
        if self.torn_step is not None:
            raise SwapStateError(self.torn_message())

    def state_replaced(self) -> None:
        """A load or restore wrote the whole state: nothing to check; its parameters are unknown."""
        self._verify_pending = False
        self.mapping.trainer.set_fingerprint(UNKNOWN)

    def verify_kept_state(self) -> bool:
        """First step after a reattach: keep the state only if the parameters are the kept
        step's; False when it was dropped just now (every view zeroed, counted in STATE_DROPS)."""
        if not self._verify_pending:
            return True
        self._verify_pending = False
        kept = self.mapping.header[Word.PARAMS_FINGERPRINT]
        if kept != UNKNOWN and kept == self._fingerprint.compute():
            return True
        why = ("the model's parameters are not those of that step (fresh weights, or weights of "
               "another step: was no checkpoint loaded?)" if kept != UNKNOWN
               else "the parameters of that step are not known (the previous trainer loaded or "
               "restored state and stopped before its next step)")
        log.warning("dropping the swap-state optimizer state kept for job %s rank %d at step %s: %s; "
                    "training starts from a fresh optimizer state. Load a checkpoint (or use a new "
                    "job id) to continue a run", self.config.job_id, self.session.rank, self.resumed_step, why)
        trainer = self.mapping.trainer
        self.mapping.before_write(0, list(self.views))
        for view in self.views.values():
            view.zero_()
        trainer.end_write()
        trainer.count_state_drop()
        trainer.set_fingerprint(UNKNOWN)
        trainer.withdraw_model()  # the model tensors were zeroed with the rest
        self.session.commit(-1)  # no committed step: the segment holds a fresh state
        self.session.last_committed_step = None
        self.resumed_step = None
        return False

    def publish(self, step: int, params_known: bool = True) -> int:
        """The parameters' fingerprint (when known), end of write, commit: in that order."""
        if params_known:
            self.mapping.trainer.set_fingerprint(self._fingerprint.compute())
        self.mapping.trainer.end_write()
        self.session.commit(step)
        return step

    def snapshot(self, step: int, metadata_parts: tuple[str, str, str], memory_only: bool = False) -> SnapshotHandle:
        """Snapshot committed ``step`` (the model's copy starts first); returns once consistent.
        ``metadata_parts``: (base id, base, delta) of its metadata; ``memory_only``: in the host's
        memory and a peer's, not on disk (``SnapshotRequest.memory_only``)."""
        area = self.model_area
        if area is not None and area.copied_step != step:
            area.copy_from_model(step)  # not copied since a load (or no step yet): now
        try:
            reply = self._send_snapshot(step, metadata_parts, memory_only)
        except SnapshotBusyError:
            # The server persists one snapshot of a segment at a time: wait, then try once more.
            self.wait_for_persisting_snapshot(f"snapshot of step {step}")
            reply = self._send_snapshot(step, metadata_parts, memory_only)
        if not self._location_logged:
            self._location_logged = True
            job, embedded_dir = self.config.job_id, self.embedded and self.embedded.snapshot_dir
            log.info("first snapshot %s goes to %s", reply.snapshot_id, os.path.join(embedded_dir, str(job))
                     if embedded_dir else f"the --snapshot-dir of server {self.config.server} (folder {job})")
        self.snapshot_handle = SnapshotHandle(reply.snapshot_id, step, self.session.rank, self.client)
        return self.snapshot_handle

    def _send_snapshot(self, step: int, metadata_parts: tuple[str, str, str], memory_only: bool) -> Any:
        ident, base, delta = metadata_parts
        retention = {**snapshot_retention(self.config), "memory_only": memory_only}
        parts = {"metadata_base_id": ident, "metadata_delta_json": delta}
        if not self._base_sent:
            parts["metadata_base_json"] = base
        try:
            reply = self.session.snapshot(step, **retention, **parts)
        except MetadataBaseUnknownError:  # a restarted server: it lost the base
            reply = self.session.snapshot(step, **retention, **parts, metadata_base_json=base)
        self._base_sent = True
        return reply

    def restore(self, snapshot_id: str, metadata_json: str, apply_metadata: Callable[[str], None]) -> int:
        """Replace every tensor with a durable snapshot's (resharded to ``metadata_json``, this
        rank's layout); ``apply_metadata(restored_json)`` runs before the commit. Returns the step."""
        self.state_replaced()  # first: a trainer killed mid-restore leaves nothing to trust
        # A snapshot still persisting may be the newest: "latest" must mean it. A restore does
        # not wait for an unreachable server: it fails fast (docs/restarts.md).
        self.wait_for_persisting_snapshot(f"restore of {snapshot_id}", server_wait_s=0.0)
        self.wait_released(f"restore of {snapshot_id}")
        if self.model_area is not None:
            self.model_area.wait_published()  # no copy of the model may land after the restore
        # Nothing to keep (a fresh or torn state): marked being written, the server copies each
        # tensor as soon as it is verified, and zeroes them when one fails (a fresh state is zero).
        replaceable = self.torn_step is not None or self.session.last_committed_step is None
        if replaceable:
            self.mapping.trainer.begin_write(0)
        try:
            reply = self._send_restore(snapshot_id, metadata_json)
        except BaseException as e:
            answered = isinstance(e, SwapStateError) and not isinstance(e, ServerUnavailableError) and e.reason
            if answered:  # the server's restore ended: the segment is as it was (fresh, or kept)
                if replaceable and self.torn_step is None:
                    self.mapping.trainer.end_write()
            elif self.torn_step is None:
                # It may have been writing (a kept state is copied in as read, put back on a
                # failure the server saw): torn until a restore or a load succeeds.
                if not replaceable:
                    self.mapping.trainer.begin_write(0)
                self.torn_step = 0
            raise
        self.torn_step = None
        self.mapping.trainer.end_write()
        if self.model_area is not None:
            self.model_area.copy_into_model(reply.step)  # the snapshot's parameters, buffers
        apply_metadata(reply.metadata_json)
        self.session.commit(reply.step)
        self.resumed_step = reply.step
        # A checkpoint of this step now refers to the restored snapshot.
        self.snapshot_handle = SnapshotHandle(reply.snapshot_id, reply.step, self.session.rank, self.client)
        resharded = reply.snapshot_world_size not in (0, self.session.world_size)
        log.info("restored %s (step %d) from the server's %s%s", reply.snapshot_id, reply.step,
                 "store" if reply.source == "store" else "snapshots (its directory, memory, replicas or peers')",
                 f", resharded from world size {reply.snapshot_world_size} (ranks {list(reply.source_ranks)})"
                 if resharded else "")
        return reply.step

    def _send_restore(self, snapshot_id: str, metadata_json: str) -> Any:
        try:
            return self.session.restore(snapshot_id, metadata_json)
        except SnapshotNotFoundError as e:
            if self.embedded is not None and self.embedded.snapshot_dir is not None:
                # An embedded server lacks what the embedded servers of a run of another size took.
                hint = embedded_world_size_hint(self.embedded.snapshot_dir, self.config.job_id, self.session.world_size)
                if hint:
                    raise SnapshotNotFoundError(f"{e}{hint}") from e
            raise

    def handle_for(self, snapshot_id: str) -> SnapshotHandle | None:
        """A handle on ``<job>/step-<N>`` for this rank (None for other forms, e.g. latest)."""
        try:
            ref = parse_snapshot_id(snapshot_id)
        except InvalidRequestError:
            return None
        return None if ref.step is None else SnapshotHandle(str(ref), ref.step, self.session.rank, self.client)

    def wait_for_persisting_snapshot(self, why: str, server_wait_s: float | None = None) -> None:
        """Wait (bounded, logged) while the header's ``SNAP_STEP`` snapshot is persisting;
        ``server_wait_s``: how long an unreachable server is tried (default: the client's)."""
        snap_step = int(self.mapping.header[Word.SNAP_STEP])
        previous = SnapshotHandle(snapshot_id_for(self.config.job_id, snap_step), snap_step,
                                  self.session.rank, self.client)
        try:
            status = previous.status(server_wait_s=server_wait_s)
        except SwapStateError:
            return  # no such snapshot, or no server: the call that follows says so
        if status.state != "persisting":
            return
        timeout_s = self.config.backpressure_timeout_s
        begin = time.monotonic()
        log.warning("%s waits for snapshot %s to finish persisting (%d of %d bytes written)",
                    why, previous.snapshot_id, status.bytes_persisted, status.bytes_total)
        while status.state == "persisting":
            remaining = begin + timeout_s - time.monotonic()
            if remaining <= 0:
                done = f"{status.bytes_persisted} of {status.bytes_total} bytes"
                raise SwapStateError(f"{why}: snapshot {previous.snapshot_id} is still persisting after "
                                     f"{timeout_s:g} s ({done})")
            status = previous.status(wait_s=min(remaining, 5.0))
        log.warning("%s waited %.3f s for snapshot %s (%s)", why, time.monotonic() - begin,
                    previous.snapshot_id, status.state)

    def wait_released(self, why: str) -> None:
        """Wait (bounded, logged) until no snapshot reads this segment (``SNAP_EPOCH == 0``)."""
        header = self.mapping.header
        if header[Word.SNAP_EPOCH] == 0:
            return
        timeout_s = self.config.backpressure_timeout_s
        begin = time.monotonic()
        if not wait_until(lambda: header[Word.SNAP_EPOCH] == 0, timeout_s=timeout_s):
            raise SwapStateError(f"{why}: the snapshot of step {header[Word.SNAP_STEP]} still reads this "
                                 f"segment after {timeout_s:g} s")
        log.warning("%s waited %.3f s for the snapshot of step %d to release the segment",
                    why, time.monotonic() - begin, header[Word.SNAP_STEP])

    def close(self, keep: bool = False) -> None:
        """Detach, unmap, close the channel, stop an embedded server: every part runs, the first
        failure is raised after. The caller drops its views first."""
        if self.closed:
            return
        self.closed = True
        with contextlib.ExitStack() as parts:  # last pushed, first run
            if self.embedded is not None:
                parts.callback(self.embedded.stop)
            parts.callback(self.client.close)
            parts.callback(self._release_mapping)
            parts.callback(self._detach, keep)

    def _detach(self, keep: bool) -> None:
        try:
            self.session.close(keep=keep)
        except SwapStateError as e:
            log.warning("detach failed: %s", e)

    def _release_mapping(self) -> None:
        if self.mapping is None:
            return
        self.session.header = None  # drop every reference to the views before unmapping
        self.views = {}
        if self.model_area is not None:
            self.model_area.close()
            self.model_area = None
        try:
            if self._backend is not None:
                self._backend.synchronize()  # no copy in flight from or to the mapping
        finally:
            self.mapping.close()  # unregisters it for DMA, then unmaps
            self.mapping = None

# -- the parameters' fingerprint ------------------------------------------------------------------
# Written with each step's commit: a reattach uses kept moments only when the parameters are those of the kept step. A
# 64-bit digest of up to SAMPLES_PER_TENSOR evenly spaced elements of every parameter's local data, bit for bit (every
# step changes essentially every element); the stride is an integer, as a float32 ``linspace`` rounds its last index out
# of range above 2^24 elements.

SAMPLES_PER_TENSOR = 64
UNKNOWN = 0
"""The header value for "parameters not known" (after a load or restore): never matches."""


def sample_stride(numel: int, count: int = SAMPLES_PER_TENSOR) -> tuple[int, int]:
    """``(samples, stride)`` of a tensor of ``numel`` elements: ``min(numel, count)`` samples
    ``stride`` elements apart from element 0, all in range (Python ints: no bound on ``numel``)."""
    count = min(numel, count)
    return count, ((numel - 1) // (count - 1) if count > 1 else 1)


def _samples(local: torch.Tensor) -> torch.Tensor | None:
    """A strided view of ``local``'s samples (a copy only when ``local`` is not contiguous)."""
    flat = local.detach().reshape(-1)
    count, stride = sample_stride(flat.numel())
    return flat.as_strided((count,), (stride,), flat.storage_offset()) if count else None


class ParamFingerprint:
    """Fingerprint of a fixed list of parameters (their order is part of it): made once,
    ``compute()`` after each update (on its stream), before the commit.

    The sample views are kept while the list of data pointers is unchanged: a kept view holds
    its storage alive, so no other allocation can take its address; when a pointer differs,
    the views of the parameters whose (pointer, dtype, size, device) changed are made again."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._dtensors = [i for i, p in enumerate(self._params) if isinstance(p, DTensor)]
        self._keys: list[tuple[int, torch.dtype, int, torch.device] | None] = [None] * len(self._params)
        self._views: list[torch.Tensor | None] = [None] * len(self._params)
        self._pointers: list[int] | None = None
        self._groups: list[list[list[torch.Tensor]]] = []

    def _current_groups(self) -> list[list[list[torch.Tensor]]]:
        """Per device, per dtype (both by name): the sample views, in parameter order."""
        locals_ = list(self._params)
        for index in self._dtensors:  # a DTensor's local shard may be swapped by FSDP
            locals_[index] = unwrap_dtensor(locals_[index])
        pointers = [local.data_ptr() for local in locals_]
        if pointers != self._pointers:
            for index, local in enumerate(locals_):
                key = (local.data_ptr(), local.dtype, local.numel(), local.device)
                if key != self._keys[index]:
                    self._keys[index], self._views[index] = key, _samples(local)
            # A stable sort: within a group, the parameters' order.
            views = sorted((v for v in self._views if v is not None), key=lambda v: (str(v.device), str(v.dtype)))
            self._groups = [[list(same) for _, same in itertools.groupby(on_device, key=lambda v: v.dtype)]
                            for _, on_device in itertools.groupby(views, key=lambda v: v.device)]
            self._pointers = pointers
        return self._groups

    def compute(self) -> int:
        """The digest (never :data:`UNKNOWN`) of the parameters as they are now."""
        digest = hashlib.blake2b(digest_size=8)
        # Raw bytes: bit-exact whatever the dtype, bfloat16 included.
        for dtypes in self._current_groups():
            gathered = [torch.cat(views).view(torch.uint8) for views in dtypes]
            joined = gathered[0] if len(gathered) == 1 else torch.cat(gathered)
            host = joined.cpu()  # the one copy to the host (and wait) per device
            digest.update(host_bytes(host))
        return int.from_bytes(digest.digest(), "little") or 1
