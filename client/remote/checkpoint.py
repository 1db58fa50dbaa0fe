"""Checkpoint modes of a remote container: ``RemoteConfig.checkpoint`` = 'full' or 'snapshot'.

'full'
    ``state_dict()`` is the seed's flat dict with the moments (views of the segment);
    ``load_state_dict()`` the seed's validated load.
'snapshot'
    ``state_dict()`` takes a server-side snapshot of the last committed step (unless one of
    that step exists) and holds only a reference to it (:data:`SNAPSHOT_REF_KEY`,
    :data:`SNAPSHOT_JOB_KEY`) plus param groups and step counts (with whole-state snapshots,
    ``RemoteConfig.snapshot_model``, the reference only: the snapshot holds those and the
    model's parameters too): no moment bytes pass through
    the trainer. ``load_state_dict()`` of such a dict restores that snapshot on the server.

Which way a load goes depends on the dict (a reference or not), not on the mode; with the
checkpoint's keys known (:mod:`swap_state.client.optim.checkpoint_template`) so does the template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from swap_state.client.optim.checkpoint_template import SNAPSHOT_JOB_KEY, SNAPSHOT_REF_KEY, holds_snapshot_reference
from swap_state.client.errors import NotFoundError, SnapshotFailedError
from swap_state.client.optim.host_cache import STEP_KEY
from swap_state.common.names import STATE_PREFIX, param_group_key

if TYPE_CHECKING:
    from swap_state.client.remote.owner import RemoteContainer
    from swap_state.client.remote.snapshots import SnapshotHandle

__all__ = ["SNAPSHOT_JOB_KEY", "SNAPSHOT_REF_KEY", "CheckpointMode", "is_moment_key"]


class CheckpointMode:
    """``state_dict()`` / ``load_state_dict()`` of a remote container in its checkpoint mode
    ('full': the seed's flat dict; 'snapshot': a reference to a server-side snapshot), held by
    the container. The seed's own dict and load are the container's ``_full_state_dict`` /
    ``_full_load_state_dict``."""

    def __init__(self, container: RemoteContainer):
        self._c = container

    _checkpoint_snapshot: SnapshotHandle | None = None
    """The snapshot the last snapshot-mode state_dict() referred to (what a checkpoint holds)."""
    _restored_reference: str | None = None
    """The reference the state was last restored from, until the next step."""

    def state_dict(self) -> dict[str, Any]:
        """Seed format in 'full' mode. In 'snapshot' mode: a reference to a server-side
        snapshot of the last committed step (taken now, unless one of that step exists),
        plus param groups and step counts (whole-state snapshots: the reference only); no
        moment bytes pass through the trainer.

        While a load announced the checkpoint's keys (``loading_checkpoint``, as the
        torchtitan glue does around ``CheckpointManager.dcp_load``), this is that
        checkpoint's template, whatever the mode: a reference (no snapshot taken) for a
        snapshot-mode checkpoint, else the full dict matched to its keys (a plain torch
        checkpoint loads its moments, also in 'snapshot' mode).

        Otherwise, still safe as a load template: a container that has committed no step (or
        whose kept state is torn) takes no snapshot; one that has (a reattached trainer) takes
        one, and the load then restores the referenced snapshot after it. In 'full' mode the
        returned moments are views that DCP loads into, so a snapshot still reading the
        segment is waited for first.
        """
        held = self._c._load_template.keys
        if held is not None:
            # A load template of a known checkpoint: its form follows the checkpoint.
            if holds_snapshot_reference(held):
                return self._reference_template()
            self._c._wait_segment_released("state_dict()")
            return self._c._full_state_dict()  # matched to the checkpoint
        if self._c.remote_config.checkpoint != "snapshot":
            # The moments are views of the segment, and DCP loads *into* a template's tensors:
            # no write may land under a snapshot still reading the segment (a restarted
            # trainer's predecessor's, say), so such a snapshot's read is waited for first.
            self._c._wait_segment_released("state_dict()")
            return self._c._full_state_dict()
        if self.snapshots_model:
            # The snapshot holds everything, param groups and steps included: the checkpoint
            # needs the reference only (no per-parameter entries: a small checkpoint).
            flat = {}
        else:
            flat = {k: v for k, v in self._c._full_state_dict().items() if not is_moment_key(k)}  # type: ignore[misc]
        flat[SNAPSHOT_REF_KEY] = self.checkpoint_reference()
        flat[SNAPSHOT_JOB_KEY] = self._c.remote_config.job_id
        return flat

    def checkpoint_reference(self) -> str:
        """The id of a server-side snapshot of the last committed step, taken now unless one
        of that step exists ("" before the first committed step, or while the kept state is
        torn): what a snapshot-mode checkpoint refers to, for the optimizer and, in a
        whole-state snapshot, the model. Returns once the model's parameters are in the
        segment (the server needs nothing more from this trainer to complete the snapshot).
        Remembered for :meth:`wait_checkpoint_durable`."""
        step = self._c.session.last_committed_step
        if self._c._torn_step is not None:
            step = None  # no consistent state to refer to (a load template, before a restore)
        if step is not None and step != self._c._snapshot_step:
            # A server being restarted or upgraded is waited for (bounded), not failed at once.
            self._c.session.wait_connected(self._c.remote_config.server_wait_s)
            self._c.snapshot()  # sets _snapshot_step and _snapshot_handle
        if self.snapshots_model:
            # A checkpoint that refers to the snapshot is a promise: once the save returns, a
            # trainer killed at once must still leave a snapshot the server can complete, and
            # the model's copy into the segment is the trainer's part of it. Waiting here costs
            # the rest of that copy (it ran beside the Snapshot call), at checkpoint steps only.
            self._c._model_area.wait_published()
        handle = self._c._snapshot_handle
        self._checkpoint_snapshot = handle
        return handle.snapshot_id if handle is not None else ""

    @property
    def snapshots_model(self) -> bool:
        """Whether the snapshots hold the model's parameters too (whole-state snapshots)."""
        return getattr(self._c, "_model_area", None) is not None

    @property
    def whole_state_checkpoints(self) -> bool:
        """Whether a checkpoint's model entry may be a reference too: snapshot mode with
        whole-state snapshots (a 'full' checkpoint keeps the model's tensors, whatever the
        snapshots hold)."""
        return self.snapshots_model and self._c.remote_config.checkpoint == "snapshot"

    def restore_reference(self, snapshot_id: str) -> None:
        """Restore the snapshot a checkpoint refers to, unless this container's state already
        is that snapshot's (the optimizer's entry of the same checkpoint restored it: the model
        entry of a whole-state checkpoint refers to the same snapshot)."""
        if snapshot_id and snapshot_id != self._restored_reference:
            self._load_snapshot_reference(snapshot_id, {})

    def wait_checkpoint_durable(self, timeout_s: float | None = None, stored: bool = False) -> None:
        """Block until the snapshot the last snapshot-mode ``state_dict()`` referred to is
        durable; raise if it failed. A checkpoint holds that reference, and a server that
        stops (the embedded one stops with its trainer) or a segment that is freed ends a
        snapshot still persisting: call it before the trainer exits (torchtitan's
        ``CheckpointManager.close`` does, through the glue). Nothing to wait for in 'full'
        mode, or after ``close()``."""
        handle = self._checkpoint_snapshot
        if handle is None or getattr(self._c, "_closed", False):
            return
        timeout_s = self._c.remote_config.backpressure_timeout_s if timeout_s is None else timeout_s
        if stored:  # in the server's --snapshot-store too
            handle.wait_stored(timeout_s=timeout_s)
        else:
            handle.wait_durable(timeout_s=timeout_s)

    def _reference_template(self) -> dict[str, Any]:
        """The template of a snapshot-mode checkpoint: the keys it holds (a whole-state one
        holds the reference only; the hyperparameters and steps then come from the
        snapshot), no moments, and no snapshot taken (the reference it holds replaces the
        placeholder)."""
        held = self._c._load_template.keys or frozenset()
        flat = {k: v for k, v in self._c._full_state_dict().items() if k in held and not is_moment_key(k)}  # type: ignore[misc]
        flat[SNAPSHOT_REF_KEY] = ""
        flat[SNAPSHOT_JOB_KEY] = self._c.remote_config.job_id
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A snapshot reference is restored on the server (verified before any byte
        changes); a full dict goes through the seed's validated load."""
        snapshot_id = state_dict.get(SNAPSHOT_REF_KEY)
        if snapshot_id is None:
            self._load_full_state_dict(state_dict)
        elif snapshot_id:  # empty: saved before the first committed step, nothing to restore
            self._load_snapshot_reference(str(snapshot_id), state_dict)

    def _load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The seed's load; it rewrites every byte, so torn state is no longer torn (unless
        the load fails)."""
        torn, self._c._torn_step = self._c._torn_step, None
        try:
            self._c._full_load_state_dict(state_dict)
        except BaseException:
            self._c._torn_step = torn
            raise

    def _load_snapshot_reference(self, snapshot_id: str, state_dict: Mapping[str, Any]) -> None:
        """Wait for the snapshot to be durable, restore it, then apply the dict's groups."""
        # The reference was saved once its snapshot was consistent; it may not be durable yet
        # (a save, then at once a load): wait for it, or for its failure.
        pending = self._c._snapshot_handle_for(snapshot_id)
        if pending is not None:
            try:
                pending.wait_durable(timeout_s=self._c.remote_config.backpressure_timeout_s)
            except NotFoundError:
                pass  # not (or no longer) known to the server: Restore says where it looked
            except SnapshotFailedError as e:
                raise SnapshotFailedError(
                    f"the checkpoint refers to snapshot {snapshot_id}, which never completed ({e}); "
                    "load an earlier checkpoint (torchtitan: --checkpoint.load_step=<step>)"
                ) from e
        self._c.restore(snapshot_id)
        self._restored_reference = snapshot_id
        self._apply_saved_param_groups(state_dict)

    def _apply_saved_param_groups(self, state_dict: Mapping[str, Any]) -> None:
        """The dict's hyperparameters (not ``params``, not ``step``: the snapshot has the
        steps) into the live groups, per parameter in update order."""
        for entry in self._c._entries:
            group = self._c.optimizers[entry.optimizer_index].param_groups[entry.group_index]
            for name in list(group):
                key = param_group_key(entry.fqn, name)
                if name not in ("params", STEP_KEY) and key in state_dict:
                    group[name] = state_dict[key]


def is_moment_key(key: str) -> bool:
    """A ``state.<fqn>.<moment>`` key (not a step): left out of a snapshot-mode dict."""
    return key.startswith(STATE_PREFIX) and not key.endswith("." + STEP_KEY)
