"""Server-side snapshots of a remote container: take, wait for, restore.

Call order, between steps::

    handle = c.snapshot()      # one RPC; returns once the snapshot is consistent
    ...                        # the trainer may step again at once
    handle.wait_durable()      # optional: blocks until it is on disk
    c.restore("latest")        # replaces moments and steps; returns the step

The trainer tells the server what it cannot know (fqns, keys, DTensor layout, param groups,
steps) in the snapshot's metadata (:mod:`swap_state.common.snapshot_metadata`); a restore
gives it back, and the param groups are applied from it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from swap_state.client.optim.dtensor_utils import global_layout
from swap_state.client.errors import (
    MetadataBaseUnknownError,
    SnapshotBusyError,
    SnapshotFailedError,
    SnapshotNotFoundError,
    SwapStateError,
)
from swap_state.client.optim.host_cache import STEP_KEY
from swap_state.client.remote.config import embedded_world_size_hint
from swap_state.client.remote.reattach import GROUP_STEPS, PARAM_STEPS, all_param_groups
from swap_state.client.remote.rpc import SwapStateClient
from swap_state.client.remote.segment_mapping import dtype_name
from swap_state.common.retry import wait_until
from swap_state.common.errors import InvalidArgument
from swap_state.common.names import parse_snapshot_id, snapshot_id_for
from swap_state.common.segment import Word
from swap_state.common.snapshot_metadata import (
    TENSOR_TAG, TensorMetadata, encode_metadata, parse_metadata, tagged_scalar,
)
from swap_state.common.snapshot_metadata_parts import base_id, encode_base, encode_delta


if TYPE_CHECKING:
    from swap_state.client.remote.owner import RemoteContainer

__all__ = ["SnapshotHandle", "SnapshotClient", "json_value"]

# The facade's name: what users configure logging for.
log = logging.getLogger("swap_state.client.remote_container")


@dataclasses.dataclass
class SnapshotHandle:
    """A snapshot in progress: ``wait_durable()`` blocks until it is on the server's disk,
    ``wait_stored()`` until it is in the server's ``--snapshot-store`` too."""

    snapshot_id: str
    step: int
    rank: int
    client: SwapStateClient

    def status(self, wait_s: float = 0.0, wait_stored: bool = False):
        return self.client.snapshot_status(self.snapshot_id, self.rank, wait_s, wait_stored)

    def wait_durable(self, timeout_s: float = 600.0):
        """The status once durable (or stored); SnapshotFailedError if it failed, TimeoutError."""
        return self._wait(timeout_s, stored=False)

    def wait_stored(self, timeout_s: float = 600.0):
        """The status once this rank's files are in the store (every host reaches it):
        SwapStateError when the upload failed (the message names the store; the snapshot is
        still durable locally), or the server has no store; TimeoutError."""
        return self._wait(timeout_s, stored=True)

    def _wait(self, timeout_s: float, stored: bool):
        deadline = time.monotonic() + timeout_s
        goal = ("stored",) if stored else ("durable", "stored")
        while True:
            remaining = deadline - time.monotonic()
            reply = self.status(wait_s=max(0.0, min(remaining, 5.0)), wait_stored=stored)
            if reply.state in goal:
                return reply
            if reply.state == "failed":
                raise SnapshotFailedError(f"snapshot {self.snapshot_id} failed: {reply.error}")
            if stored and reply.state == "durable" and reply.store_state in ("", "failed"):
                why = reply.store_error or "the server has no --snapshot-store"
                raise SwapStateError(f"snapshot {self.snapshot_id} is durable but not stored: {why}")
            if remaining <= 0:
                what = "stored" if stored else "durable"
                done = reply.bytes_stored if stored else reply.bytes_persisted
                raise TimeoutError(
                    f"snapshot {self.snapshot_id} not {what} after {timeout_s}s "
                    f"({done}/{reply.bytes_total} bytes)"
                )


class SnapshotClient:
    """Snapshots and restores of a remote container, held by it (call order in the module
    docstring). Owns the last snapshot taken or restored; reads the container's session,
    client, config, segment, host cache and reattach state."""

    def __init__(self, container: RemoteContainer):
        self._c = container

    _snapshot_step: int | None = None
    """The step the last snapshot taken (or restored) holds."""
    _snapshot_handle: SnapshotHandle | None = None
    _snapshot_location_logged: bool = False

    def snapshot_metadata(self) -> str:
        """What the server cannot know: fqns, keys, DTensor layout, param groups, steps."""
        tensors: dict[str, TensorMetadata] = {}
        steps: dict[str, float] = {}
        param_groups: dict[str, dict[str, Any]] = {}
        flat_groups = self.state_dict_param_groups()
        for entry in self._c._entries:
            global_shape, global_offset = global_layout(entry.param) or (None, None)
            for key, name in zip(entry.keys, self._c._tensor_names[entry.param]):
                tensors[name] = TensorMetadata(entry.fqn, key, global_shape, global_offset)
            steps[entry.fqn] = float(self._c.param_to_cpu_states_map[entry.param][STEP_KEY])
            param_groups[entry.fqn] = flat_groups[entry.fqn]
        area = self._c._model_area
        if area is None:
            return encode_metadata(tensors, param_groups, steps)
        tensors.update(area.metadata())
        return encode_metadata(tensors, param_groups, steps, area.aliases())

    _metadata_base: tuple[str, str] | None = None
    """(id, text) of the snapshot metadata's base: what does not change between snapshots,
    encoded once (:mod:`swap_state.common.snapshot_metadata_parts`)."""
    _base_sent: bool = False
    """The server has acknowledged the base once (it answers METADATA_BASE_UNKNOWN when a
    restarted one lost it)."""

    def metadata_parts(self) -> tuple[str, str, str]:
        """(base id, base, delta): :meth:`snapshot_metadata` in two parts, the base built once.
        Per snapshot only the param groups' hyperparameters and one read of every step count."""
        if self._metadata_base is None:
            tensors: dict[str, TensorMetadata] = {}
            offsets = group_offsets(self._c.optimizers)
            for entry in self._c._entries:
                global_shape, global_offset = global_layout(entry.param) or (None, None)
                for key, name in zip(entry.keys, self._c._tensor_names[entry.param]):
                    tensors[name] = TensorMetadata(entry.fqn, key, global_shape, global_offset)
            area = self._c._model_area
            if area is not None:
                tensors.update(area.metadata())
            text = encode_base(tensors, area.aliases() if area is not None else None,
                               [e.fqn for e in self._c._entries],
                               [offsets[e.optimizer_index] + e.group_index for e in self._c._entries])
            self._metadata_base = (base_id(text), text)
        groups = [{k: json_value(v) for k, v in group.items() if k != "params"}
                  for group in all_param_groups(self._c.optimizers)]
        counts = self._c._views[PARAM_STEPS]  # the per-parameter steps are one tensor
        steps = float(counts[0]) if len(counts) and bool((counts == counts[0]).all()) else counts.tolist()
        return self._metadata_base[0], self._metadata_base[1], encode_delta(groups, steps)

    def _send_snapshot(self, step: int, retention: dict[str, Any]) -> Any:
        """The Snapshot RPC with the metadata in parts: the base only until the server has it."""
        ident, base, delta = self.metadata_parts()
        parts = {"metadata_base_id": ident, "metadata_delta_json": delta}
        if not self._base_sent:
            parts["metadata_base_json"] = base
        try:
            reply = self._c.session.snapshot(step, **retention, **parts)
        except MetadataBaseUnknownError:  # a restarted server: it lost the base
            reply = self._c.session.snapshot(step, **retention, **parts, metadata_base_json=base)
        self._base_sent = True
        return reply

    def state_dict_param_groups(self) -> dict[str, dict[str, Any]]:
        """Per canonical fqn, the JSON form of its param group's hyperparameters."""
        out: dict[str, dict[str, Any]] = {}
        for entry in self._c._entries:
            group = self._c.optimizers[entry.optimizer_index].param_groups[entry.group_index]
            out[entry.fqn] = {k: json_value(v) for k, v in group.items() if k != "params"}
        return out

    def snapshot(self) -> SnapshotHandle:
        """Snapshot the last committed step on the server; returns once it is consistent.

        Call between steps (after ``step()``). The trainer may step again at once; the
        handle's ``wait_durable()`` says when it is on disk. A whole-state snapshot's copy of
        the model goes on after this returns (the next update waits for it): a trainer that
        dies before it lands fails the snapshot. A checkpoint's reference waits for it
        (:meth:`CheckpointMode.checkpoint_reference`).
        """
        # Kept state of a reattach is checked against the model before anything refers to it.
        self._c._verify_kept_state()
        step = self._c.session.last_committed_step
        if step is None:
            step = self._c._publish_step()
        area = self._c._model_area
        if area is not None and area.copied_step != step:
            area.copy_from_model(step)  # not copied since a load (or no step yet): now
        retention = self.snapshot_retention()
        try:
            reply = self._send_snapshot(step, retention)
        except SnapshotBusyError:
            # The server persists one snapshot of a segment at a time: a previous one (this
            # trainer's, or a restarted trainer's predecessor's) may still be persisting. Wait
            # for it and try once more; any other refusal comes back as it is.
            self._wait_for_persisting_snapshot(f"snapshot of step {step}")
            reply = self._send_snapshot(step, retention)
        handle = SnapshotHandle(reply.snapshot_id, step, self._c.session.rank, self._c.client)
        if not self._snapshot_location_logged:
            self._snapshot_location_logged = True
            log.info("first snapshot %s goes to %s", reply.snapshot_id, self.snapshot_location())
        self._snapshot_step, self._snapshot_handle = step, handle
        return handle

    def snapshot_retention(self) -> dict[str, Any]:
        """The ``keep_latest`` / ``keep_all`` / ``replace_existing`` this job's snapshots carry
        (``RemoteConfig.snapshot_keep_latest`` and ``snapshot_replace_existing``; {}: the
        server's --keep-latest alone, and no replacing)."""
        config = self._c.remote_config
        retention: dict[str, Any] = {"replace_existing": True} if config.snapshot_replace_existing else {}
        keep = config.snapshot_keep_latest
        if keep is not None:
            retention.update({"keep_all": True} if keep == 0 else {"keep_latest": int(keep)})
        return retention

    def follow_checkpoint_retention(self, keep_latest_k: int) -> None:
        """Keep at least the snapshots the job's checkpoints still refer to: its checkpoint
        retention (torchtitan's ``keep_latest_k``; 0: all) becomes
        ``RemoteConfig.snapshot_keep_latest``, unless that was set explicitly."""
        # A checkpointing framework overwrites the checkpoint of a step it trains again (after
        # loading an older one): the snapshot that checkpoint refers to is overwritten with it.
        self._c.remote_config.snapshot_replace_existing = True
        if self._c.remote_config.snapshot_keep_latest is not None:
            return
        keep = int(keep_latest_k)
        if keep < 0:
            raise ValueError(f"checkpoint.keep_latest_k must be >= 0, got {keep_latest_k!r}")
        self._c.remote_config.snapshot_keep_latest = keep
        log.info(
            "snapshots of job %s follow the checkpoint retention: %s",
            self._c.remote_config.job_id, "keep all" if keep == 0 else f"keep the latest {keep}",
        )  # fmt: skip

    def snapshot_location(self) -> str:
        """Where this job's snapshots are persisted, in words (the directory when the server
        is this container's embedded one)."""
        embedded = getattr(self._c, "_embedded", None)
        job = self._c.remote_config.job_id
        if embedded is not None and embedded.snapshot_dir:
            return os.path.join(embedded.snapshot_dir, str(job))
        return f"the --snapshot-dir of server {self._c.remote_config.server} (folder {job})"

    def restore(self, snapshot_id: str = "latest") -> int:
        """Replace the moments and steps with a durable snapshot's; returns its step.

        The server verifies layout and checksums before it writes a byte; on a mismatch it
        raises and the current state is untouched. Call between steps.
        """
        # A snapshot of this segment still persisting (a killed predecessor's, say) may be the
        # newest: let it become durable first, so "latest" means it.
        self._wait_for_persisting_snapshot(f"restore of {snapshot_id}")
        self._wait_segment_released(f"restore of {snapshot_id}")
        if self._c._model_area is not None:
            self._c._model_area.wait_published()  # no copy of the model may land after the restore
        try:
            reply = self._c.session.restore(snapshot_id, self.snapshot_metadata())
        except SnapshotNotFoundError as e:
            hint = self._embedded_hint()
            if hint:
                raise SnapshotNotFoundError(f"{e}{hint}") from e
            raise
        self._c._torn_step = None
        self._c._guard.end_write()
        if self._c._model_area is not None:
            self._c._model_area.copy_into_model(reply.step)  # the snapshot's parameters, buffers
        self._apply_restored_metadata(reply.metadata_json)
        self._c._load_group_steps_from_segment()
        self._c.session.commit(reply.step)
        self._c.resumed_step = reply.step
        # The state is now that snapshot's: a state_dict() of this step refers to it (a new
        # snapshot of the step would copy the same bytes, or be refused as existing).
        self._snapshot_step = reply.step
        self._snapshot_handle = SnapshotHandle(reply.snapshot_id, reply.step, self._c.session.rank, self._c.client)
        resharded = reply.snapshot_world_size not in (0, self._c.session.world_size)
        log.info(
            "restored %s (step %d) from the server's %s%s", reply.snapshot_id, reply.step,
            "store" if reply.source == "store" else "snapshot directory",
            f", resharded from world size {reply.snapshot_world_size} (ranks {list(reply.source_ranks)})"
            if resharded else "",
        )  # fmt: skip
        return reply.step

    def _embedded_hint(self) -> str:
        """What to do when this trainer's embedded server lacks a snapshot that the embedded
        servers of a run of another size took ("" for a host's server, or nothing to say)."""
        embedded = self._c._embedded
        if embedded is None or embedded.snapshot_dir is None:
            return ""
        return embedded_world_size_hint(embedded.snapshot_dir, self._c.remote_config.job_id, self._c.session.world_size)

    def _apply_restored_metadata(self, metadata_json: str) -> None:
        """The snapshot's hyperparameters into the live groups, and every parameter's and
        group's step into the segment's bookkeeping (``BOOKKEEPING_PREFIX``): a restore at
        another layout (another pipeline split) does not copy those, the metadata says them
        per fqn. The group steps are then read back from the segment."""
        if not metadata_json:
            return
        restored = parse_metadata(metadata_json, self._c._mapping.tensors, max_bytes=sys.maxsize)
        groups = restored.param_groups
        param_steps, group_steps = self._c._views[PARAM_STEPS], self._c._views[GROUP_STEPS]
        offsets = group_offsets(self._c.optimizers)
        for index, entry in enumerate(self._c._entries):
            if entry.fqn in restored.steps:
                param_steps[index] = _step_value(restored.steps[entry.fqn])
            saved = groups.get(entry.fqn)
            if not saved:
                continue
            group = self._c.optimizers[entry.optimizer_index].param_groups[entry.group_index]
            for key, value in saved.items():
                if key != STEP_KEY and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
            if STEP_KEY in saved:
                group_steps[offsets[entry.optimizer_index] + entry.group_index] = _step_value(saved[STEP_KEY])

    def _snapshot_handle_for(self, snapshot_id: str) -> SnapshotHandle | None:
        """A handle on ``<job>/step-<N>`` (either spelling of the step) for this rank, named
        by the short id (None for other forms, e.g. latest)."""
        try:
            ref = parse_snapshot_id(snapshot_id)
        except InvalidArgument:
            return None
        if ref.step is None:
            return None
        return SnapshotHandle(str(ref), ref.step, self._c.session.rank, self._c.client)

    def _wait_for_persisting_snapshot(self, why: str) -> None:
        """If the snapshot this segment's header names (``SNAP_STEP``) is still persisting,
        wait until it is durable or failed (bounded by ``backpressure_timeout_s``; logged)."""
        snap_step = int(self._c._mapping.header[Word.SNAP_STEP])
        snapshot_id = snapshot_id_for(self._c.remote_config.job_id, snap_step)
        previous = SnapshotHandle(snapshot_id, snap_step, self._c.session.rank, self._c.client)
        try:
            status = previous.status()
        except SwapStateError:
            return  # no such snapshot
        if status.state != "persisting":
            return
        timeout_s = self._c.remote_config.backpressure_timeout_s
        begin = time.monotonic()
        log.warning(
            "%s waits for snapshot %s to finish persisting (%d of %d bytes written)",
            why, previous.snapshot_id, status.bytes_persisted, status.bytes_total,
        )  # fmt: skip
        while status.state == "persisting":
            remaining = begin + timeout_s - time.monotonic()
            if remaining <= 0:
                raise SwapStateError(
                    f"{why}: snapshot {previous.snapshot_id} is still persisting after "
                    f"{timeout_s:g} s ({status.bytes_persisted} of {status.bytes_total} bytes)"
                )
            status = previous.status(wait_s=min(remaining, 5.0))
        log.warning(
            "%s waited %.3f s for snapshot %s (%s)",
            why, time.monotonic() - begin, previous.snapshot_id, status.state,
        )  # fmt: skip

    def _wait_segment_released(self, why: str) -> None:
        """Wait (bounded, logged) until no snapshot reads this segment (``SNAP_EPOCH == 0``,
        the server's condition for writing into it)."""
        header = self._c._mapping.header
        if header[Word.SNAP_EPOCH] == 0:
            return
        timeout_s = self._c.remote_config.backpressure_timeout_s
        begin = time.monotonic()
        if not wait_until(lambda: header[Word.SNAP_EPOCH] == 0, timeout_s=timeout_s):
            raise SwapStateError(
                f"{why}: the snapshot of step {header[Word.SNAP_STEP]} still reads this "
                f"segment after {timeout_s:g} s"
            )
        log.warning(
            "%s waited %.3f s for the snapshot of step %d to release the segment",
            why, time.monotonic() - begin, header[Word.SNAP_STEP],
        )  # fmt: skip


def json_value(value: Any) -> Any:
    """A hyperparameter in the metadata's JSON form: a 0-dim tensor tagged, a tuple a list."""
    if isinstance(value, torch.Tensor):
        return tagged_scalar(float(value), dtype_name(value.dtype))
    if isinstance(value, tuple):
        return list(value)
    return value


def group_offsets(optimizers: Sequence[Any]) -> list[int]:
    """Where each optimizer's param groups start in the segment's ``GROUP_STEPS``."""
    offsets = [0]
    for optimizer in optimizers:
        offsets.append(offsets[-1] + len(optimizer.param_groups))
    return offsets


def _step_value(value: Any) -> float:
    """A step count as the metadata holds it (a number, or a tagged 0-dim tensor)."""
    return float(value[TENSOR_TAG]) if isinstance(value, dict) else float(value)