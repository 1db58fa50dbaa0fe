"""Reattach: what a kept segment says about the step it holds, and torn state.

A trainer that restarts with the same job id and rank within the server's ``--grace`` gets
its segment back (``reused``). The header's ``WRITING_STEP`` says whether the previous
trainer died in the middle of a step (the moments are then *torn*: some of step S, some of
S-1, and nothing may step until a restore or a full load rewrites them); otherwise the
segment's group steps say which step it holds.

Kept moments are a claim to check: they are used only when the model's parameters are those
of the kept step (the fingerprint written with each commit, compared before the first step)
or when a load or restore replaces them; otherwise they are dropped with a WARNING and
training starts from a fresh optimizer state.

Call order (from the container's ``_allocate_host_cache``, then its ``__init__``, then its
first step)::

    _check_resumable(reply.reused)   # torn -> _torn_step; else resumed_step (may commit)
    ...                              # the container installs the host cache
    _resume_group_steps()            # group steps from the segment, like the moments
    ...                              # a load_state_dict / restore may replace the state
    _verify_kept_state()             # first step: fingerprint check, else drop the state
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from swap_state.client.errors import SwapStateError
from swap_state.client.optim.host_cache import STEP_KEY
from swap_state.client.remote.fingerprint import UNKNOWN, ParamFingerprint
from swap_state.common.segment import Word
from swap_state.common.snapshot_metadata import BOOKKEEPING_PREFIX


if TYPE_CHECKING:
    from swap_state.client.remote.owner import RemoteContainer

__all__ = ["GROUP_STEPS", "PARAM_STEPS", "ReattachCheck", "all_param_groups"]

# The facade's name: what users configure logging for.
log = logging.getLogger("swap_state.client.remote_container")

#: Segment tensors beside the moments: every parameter's step, every param group's step.
PARAM_STEPS = BOOKKEEPING_PREFIX + "param_steps"
GROUP_STEPS = BOOKKEEPING_PREFIX + "group_steps"


class ReattachCheck:
    """Reattach and torn state of a remote container, held by it (call order in the module
    docstring). Owns the torn step, the step a reattach resumed at and the fingerprint check;
    reads the container's session, segment mapping and views, and its optimizers."""

    def __init__(self, container: RemoteContainer):
        self._c = container
        self._fingerprint: ParamFingerprint | None = None

    _torn_step: int | None = None
    """The step the previous trainer died writing, while the kept moments are torn."""
    resumed_step: int | None = None
    """The step a reattach (or a restore) resumed at; None for a fresh segment."""
    _verify_pending: bool = False
    """A reattach kept state that is not yet checked against the model's parameters."""
    _fresh_group_steps: tuple[Any, ...] = ()
    """Every param group's step as a fresh container has it (what a dropped state gets)."""

    def _check_resumable(self, reused: bool) -> None:
        """Read the kept segment's header: torn, resumable, or fresh; claim the header."""
        header = self._c._mapping.header
        # Claim the segment first: a predecessor still running now fails its next commit.
        self._c._mapping.trainer.claim(self._c.session.generation)
        self._torn_step = None
        if reused and header[Word.WRITING_STEP] != 0:
            # The previous trainer died mid-step: some moments are of step S, some of S-1.
            self._torn_step = header[Word.WRITING_STEP] - 1
            log.warning("%s", self._torn_message())
        elif reused:
            self._resume_kept_step()
        elif getattr(self._c.session, "previous_session", ""):
            # A fresh segment where the job may have expected its kept state: say why.
            log.info("no swap-state optimizer state kept for this trainer: %s", self._c.session.previous_session)

    def _resume_kept_step(self) -> None:
        """The step the kept segment holds is the one its group steps say (written with the
        moments, before the commit). A trainer killed between its last write and its
        commit leaves one step more than the server recorded: complete, so it is
        committed now rather than mistaken for the step before."""
        held = int(max(self._c._views[GROUP_STEPS].tolist(), default=0))
        committed = self._c.session.last_committed_step
        if held == 0 and committed is None:
            return  # nothing was ever written
        if held != committed:
            log.warning(
                "the previous trainer wrote step %d completely but the server recorded step %d "
                "(killed before its commit): resuming at step %d", held, committed, held,
            )  # fmt: skip
            self._c.session.commit(held)
        self.resumed_step = held
        log.info("reattached to swap-state at step %d", held)

    def _torn_message(self) -> str:
        return (
            f"the kept optimizer state of {self._c.remote_config.job_id}/rank {self._c.session.rank} "
            f"is torn: the previous trainer died while writing step {self._torn_step}. "
            "Restore a snapshot (container.restore('latest')) or load a full checkpoint "
            "before stepping, or use a new job id"
        )

    def _check_not_torn(self) -> None:
        """Refuse to write into torn state: only a restore or a full load may."""
        if self._torn_step is not None:
            raise SwapStateError(self._torn_message())

    def _resume_group_steps(self) -> None:
        """After a reattach, the group steps come back from the segment like the moments."""
        self._fingerprint = ParamFingerprint([entry.param for entry in self._c._entries])
        self._fresh_group_steps = tuple(_clone(g.get(STEP_KEY)) for g in all_param_groups(self._c.optimizers))
        if self.resumed_step is not None:
            self._load_group_steps_from_segment()
            self._verify_pending = True

    def _state_replaced(self) -> None:
        """A load or a restore wrote the whole state: nothing kept is left to check, and the
        parameters that go with it are not known (a later reattach must not trust them)."""
        self._verify_pending = False
        self._c._mapping.trainer.set_fingerprint(UNKNOWN)

    def _write_fingerprint(self) -> None:
        """With each commit, before it: the parameters of the step being committed."""
        self._c._mapping.trainer.set_fingerprint(self._fingerprint.compute())

    def _verify_kept_state(self) -> None:
        """Before the first step after a reattach: keep the state only if the parameters are
        the kept step's; else drop it (WARNING, counted in the header's STATE_DROPS)."""
        if not self._verify_pending:
            return
        self._verify_pending = False
        kept = self._c._mapping.header[Word.PARAMS_FINGERPRINT]
        if kept != UNKNOWN and kept == self._fingerprint.compute():
            return
        why = (
            "the model's parameters are not those of that step (fresh weights, or weights of "
            "another step: was no checkpoint loaded?)"
            if kept != UNKNOWN
            else "the parameters of that step are not known (the previous trainer loaded or "
            "restored state and stopped before its next step)"
        )
        log.warning(
            "dropping the swap-state optimizer state kept for job %s rank %d at step %s: %s; "
            "training starts from a fresh optimizer state. Load a checkpoint (or use a new "
            "job id) to continue a run", self._c.remote_config.job_id, self._c.session.rank,
            self.resumed_step, why,
        )  # fmt: skip
        self._reset_to_fresh_state()

    def _reset_to_fresh_state(self) -> None:
        """Moments, step counts and group steps as a fresh container has them."""
        self._c._guard.before_write(0, list(self._c._views))
        for view in self._c._views.values():
            view.zero_()
        for group, step in zip(all_param_groups(self._c.optimizers), self._fresh_group_steps):
            if step is None:
                group.pop(STEP_KEY, None)
            else:
                group[STEP_KEY] = _clone(step)
        self._c._guard.end_write()
        trainer = self._c._mapping.trainer
        trainer.count_state_drop()
        trainer.set_fingerprint(UNKNOWN)
        trainer.withdraw_model()  # the model tensors were zeroed with the rest
        self._c.session.commit(-1)  # no committed step: the segment holds a fresh state
        self._c.session.last_committed_step = None
        self.resumed_step = None

    def _load_group_steps_from_segment(self) -> None:
        """Every param group's step := the segment's (copies: the group owns its tensor)."""
        group_steps = self._c._views[GROUP_STEPS]
        for index, group in enumerate(all_param_groups(self._c.optimizers)):
            group[STEP_KEY] = group_steps[index].clone()


def all_param_groups(optimizers: list[Any]) -> list[dict[str, Any]]:
    """Every param group of every optimizer, in the segment's ``GROUP_STEPS`` order."""
    return [g for o in optimizers for g in o.param_groups]


def _clone(value: Any) -> Any:
    return value.clone() if hasattr(value, "clone") else value
