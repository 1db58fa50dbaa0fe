"""How much shared memory a job needs: what ``swap-state plan`` prints and the trainer logs at
attach. Per rank: the Adam moments (two per parameter, three with amsgrad) and, with
whole-state snapshots, a copy of the parameters; per host, plus a copy pool for what the disk
cannot persist within one forward/backward (:func:`~.segment.copy_budget_needed`).
"""

from __future__ import annotations

import dataclasses
import math

from .segment import ASSUMED_FWD_BWD_S, ASSUMED_PERSIST_BYTES_PER_S, copy_budget_needed
from .sizes import GiB, MiB, format_size

__all__ = ["SizingPlan", "plan_for_rank", "plan_sizes", "replica_lines"]

_HEADROOM = 0.02
"""Headers, step counts, page rounding: a little over the tensors' bytes."""


@dataclasses.dataclass(frozen=True)
class SizingPlan:
    params_per_rank: int
    """Parameters whose state one rank holds (its shard with FSDP, all without)."""
    moments_per_rank: int
    """Bytes of Adam moments per rank."""
    model_copy_per_rank: int
    """Bytes of the parameters' copy per rank (whole-state snapshots; 0 without)."""
    ranks_per_host: int
    """Ranks (segments) on one host's server."""
    copy_pool: int
    """The host's copy pool (``--cow-budget``): for pause-free snapshots, else the server's default."""
    snapshots: bool
    """Whether the plan is for snapshots without a pause (whole-state checkpoints)."""
    shm_size: int
    """The ``--shm-size`` to give each host's server (whole GiB)."""

    @property
    def per_rank(self) -> int:
        return self.moments_per_rank + self.model_copy_per_rank

    @property
    def per_host(self) -> int:
        return self.per_rank * self.ranks_per_host

    def lines(self) -> list[str]:
        copy = f" + model copy {format_size(self.model_copy_per_rank)}" if self.model_copy_per_rank else ""
        if self.snapshots:
            pool = f"+ copy pool {format_size(self.copy_pool)} (what the disk cannot persist within a forward/backward)"
            flags = f"--shm-size {self.shm_size // GiB}G --cow-budget {max(1, -(-self.copy_pool // GiB))}G"
        else:
            pool = f"+ the server's default copy pool {format_size(self.copy_pool)} (no snapshots planned)"
            flags = f"--shm-size {self.shm_size // GiB}G"
        return [
            f"per rank:  {self.params_per_rank:,} parameters: moments {format_size(self.moments_per_rank)}{copy} "
            f"= {format_size(self.per_rank)}",
            f"per host:  {self.ranks_per_host} ranks = {format_size(self.per_host)} of segments, {pool}",
            f"server:    swap-state-server {flags}  (and at least as much in /dev/shm: docker "
            "--shm-size, or a Memory emptyDir's sizeLimit)"]


def plan_sizes(params: int, world_size: int, ranks_per_host: int, *, sharded: bool = True, moment_bytes: int = 4,
               model_bytes_per_param: int = 0, amsgrad: bool = False, snapshots: bool = False,
               persist_bytes_per_s: float = ASSUMED_PERSIST_BYTES_PER_S,
               fwd_bwd_s: float = ASSUMED_FWD_BWD_S) -> SizingPlan:
    """The plan for ``params`` parameters on ``world_size`` ranks, ``ranks_per_host`` per host.
    ``sharded``: FSDP (else every rank holds all); ``model_bytes_per_param``: the parameters'
    copy of whole-state snapshots (0 without); ``snapshots``: size the pool for no pause."""
    if params <= 0 or world_size <= 0 or not 0 < ranks_per_host <= world_size:
        raise ValueError(f"need params > 0 and 0 < ranks per host ({ranks_per_host}) <= world size ({world_size})")
    per_rank_params = -(-params // world_size) if sharded else params
    return plan_for_rank(per_rank_params, per_rank_params * moment_bytes * (3 if amsgrad else 2),
                         per_rank_params * model_bytes_per_param, ranks_per_host, snapshots=snapshots,
                         persist_bytes_per_s=persist_bytes_per_s, fwd_bwd_s=fwd_bwd_s)


def plan_for_rank(params_per_rank: int, moments_per_rank: int, model_copy_per_rank: int, ranks_per_host: int, *,
                  snapshots: bool = False, persist_bytes_per_s: float = ASSUMED_PERSIST_BYTES_PER_S,
                  fwd_bwd_s: float = ASSUMED_FWD_BWD_S) -> SizingPlan:
    """The plan from one rank's bytes (what a trainer knows at attach)."""
    host_state = (moments_per_rank + model_copy_per_rank) * ranks_per_host
    segments = int(host_state * (1 + _HEADROOM)) + 64 * MiB
    if snapshots:
        pool = copy_budget_needed(host_state, persist_bytes_per_s, fwd_bwd_s)
    else:  # the server's own default (--cow-budget auto), held back from --shm-size
        pool = min(GiB, -(-segments // GiB) * GiB // 7)
    shm_size = -(-(segments + pool) // GiB) * GiB
    return SizingPlan(params_per_rank, moments_per_rank, model_copy_per_rank, ranks_per_host, pool, snapshots, shm_size)


def replica_lines(plan: SizingPlan, link_bytes_per_s: float, step_s: float) -> list[str]:
    """Memory-only snapshots sent to a peer (``--replica-peers``): the shortest replica interval
    (a host's state sent within the steps between two, so one never waits for the last) and
    the memory they hold, here and at the peer: a job's newest two, and the pages of the one
    removed before, which the next is written over (fresh tmpfs pages are slower to fill)."""
    if link_bytes_per_s <= 0 or step_s <= 0:
        raise ValueError("the link's GB/s and the step's seconds must be > 0")
    send_s = plan.per_host / link_bytes_per_s
    interval = max(1, math.ceil(send_s / step_s))
    held = 3 * plan.per_host
    return [f"replicas:  a host's {format_size(plan.per_host)} takes {send_s:.1f} s to send at "
            f"{link_bytes_per_s / 1e9:g} GB/s: replica_interval >= {interval} steps of {step_s:g} s; a lost host "
            f"costs at most that many steps",
            f"           each peer: --replica-size {max(1, -(-held // GiB))}G; memory-only snapshots take "
            f"{format_size(held)} of this host's /dev/shm beside --shm-size"]
