"""The one grammar for ids and keys: job ids (restricted: they become directory names and metric
labels), snapshot ids, step directories, the seed's flat keys, and ``model.<fqn>``: a whole-state
snapshot's model tensors, after every other tensor.
"""

from __future__ import annotations

import dataclasses
import re

from .errors import InvalidRequestError

__all__ = [
    "JOB_ID_RULE", "SnapshotRef", "is_job_id", "validate_job_id", "shorten", "snapshot_id_for",
    "parse_snapshot_id", "step_dir_name", "parse_step_dir_name", "state_key", "param_group_key",
    "STATE_PREFIX", "PARAM_GROUPS_PREFIX", "MODEL_PREFIX", "model_tensor_name", "is_model_tensor"]

JOB_ID_RULE = "1-128 characters of [A-Za-z0-9_.-], not starting with '.'"
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SNAPSHOT_ID = re.compile(r"(?:(?P<job>[^/]+)/)?(?:step-(?P<step>\d{1,20})|(?P<latest>latest))")
_STEP_DIR = re.compile(r"step-(\d{12,})")
STATE_PREFIX = "state."
PARAM_GROUPS_PREFIX = "param_groups."
MODEL_PREFIX = "model."


def shorten(value: object, limit: int = 80) -> str:
    """``repr`` of a client-sent value, cut to ``limit`` characters (messages travel back as gRPC
    metadata, whose size limit a hostile id must not reach)."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def is_job_id(job_id: object) -> bool:
    # '.', '..' and hidden names would be dangerous or confusing as directory names.
    return isinstance(job_id, str) and bool(_JOB_ID.fullmatch(job_id)) and not job_id.startswith(".")


def validate_job_id(job_id: object, error: type[Exception] = InvalidRequestError) -> str:
    """``job_id`` if it follows the rule, else ``error`` (a subclass of InvalidRequestError)."""
    if not is_job_id(job_id):
        raise error(f"job_id {shorten(job_id)} is invalid: use {JOB_ID_RULE}")
    return job_id  # type: ignore[return-value]


def snapshot_id_for(job_id: str, step: int) -> str:
    """The id the protocol uses: ``<job_id>/step-<step>`` (no zero padding)."""
    return f"{job_id}/step-{step}"


@dataclasses.dataclass(frozen=True)
class SnapshotRef:
    """A parsed snapshot id: a job and either a step or ``latest`` (``step is None``)."""

    job_id: str
    step: int | None

    @property
    def latest(self) -> bool:
        return self.step is None

    def __str__(self) -> str:
        return f"{self.job_id}/latest" if self.step is None else snapshot_id_for(self.job_id, self.step)


def parse_snapshot_id(snapshot_id: object, job_id: str | None = None,
                      error: type[Exception] = InvalidRequestError) -> SnapshotRef:
    """``<job>/step-<N>`` (any zero padding), ``<job>/latest``, or ``latest`` / ``step-<N>`` of
    ``job_id``; anything else raises ``error`` naming the accepted forms."""
    match = _SNAPSHOT_ID.fullmatch(snapshot_id) if isinstance(snapshot_id, str) else None
    if match is None:
        raise error(f"snapshot id {shorten(snapshot_id)} is not '<job>/step-<N>' (e.g. demo/step-25 or "
                    "demo/step-000000000025), '<job>/latest' or 'latest'")
    job = match.group("job") or job_id
    if job is None:
        raise error(f"snapshot id {shorten(snapshot_id)} needs a job id")
    validate_job_id(job, error)
    step = match.group("step")
    return SnapshotRef(job, None if step is None else int(step))


def step_dir_name(step: int) -> str:
    """The directory of a complete snapshot: ``step-<N>`` zero padded to 12 digits."""
    return f"step-{step:012d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a complete-snapshot directory name, or None for anything else."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def state_key(fqn: str, key: str) -> str:
    """``state.<fqn>.<key>``: one per-parameter optimizer state entry (exp_avg, step, ...)."""
    return f"{STATE_PREFIX}{fqn}.{key}"


def param_group_key(fqn: str, hyperparameter: str) -> str:
    """``param_groups.<fqn>.<hyperparameter>``: the seed's per-parameter group entry."""
    return f"{PARAM_GROUPS_PREFIX}{fqn}.{hyperparameter}"


def model_tensor_name(fqn: str) -> str:
    """``model.<fqn>``: the segment tensor of one model parameter or persistent buffer."""
    return f"{MODEL_PREFIX}{fqn}"


def is_model_tensor(name: str) -> bool:
    """Whether a segment tensor is part of the model (the whole-state part of a snapshot)."""
    return name.startswith(MODEL_PREFIX)
