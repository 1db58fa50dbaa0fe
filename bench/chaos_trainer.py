"""The chaos run's trainer (``python -m bench.chaos_trainer``): one job's ranks in lockstep in
one process (data-parallel replicas: the same model and data), whole-state snapshots every few
steps, its progress as JSON lines for :mod:`bench.chaos` to check.

It resumes from the job's newest snapshot when there is one (model and moments: whole state),
else starts fresh; a snapshot tier it cannot read is waited for, never taken for "none". Its
numbers are plain AdamW's: :class:`Reference` trains the same model on the same data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.nn as nn

from swap_state.client.errors import ServerUnavailableError, SessionLostError, SwapStateError
from swap_state.client.remote.config import RemoteConfig
from swap_state.client.remote.container import RemoteSwapOptimizersContainer

__all__ = ["LR", "Reference", "build", "batch"]

LR = 1e-2
WIDTH = 64


def build(job: str) -> nn.Module:
    """The job's model, the same for every rank and run."""
    torch.manual_seed(_seed(job, 0))
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def batch(job: str, step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(_seed(job, step)))


def _seed(job: str, step: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{job}/{step}".encode(), digest_size=4).digest(), "little")


def _train_step(model: nn.Module, optimizer, job: str, step: int) -> None:
    model(batch(job, step)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


class Reference:
    """Plain fused AdamW trained on ``job``'s data, advanced step by step (:meth:`at`)."""

    def __init__(self, job: str):
        self.job, self.step = job, 0
        self.model = build(job)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)

    def at(self, step: int) -> Reference:
        """This reference at ``step`` (a fresh one when ``step`` is behind it)."""
        reference = self if step >= self.step else Reference(self.job)
        for next_step in range(reference.step + 1, step + 1):
            _train_step(reference.model, reference.optimizer, reference.job, next_step)
        reference.step = step
        return reference


class _Progress:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    def __call__(self, event: str, **fields) -> None:
        self._file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def _resume(containers, job: str, progress: _Progress, wait_s: float) -> int:
    """The step to train from: the newest snapshot's, restored into every rank, else 0."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            listed = containers[0].client.list_snapshots(job)
            if not listed.snapshots and listed.store_error:
                raise SwapStateError(f"the store could not be read: {listed.store_error}")
            if not listed.snapshots:
                progress("start", step=0, source="fresh")
                return 0
            steps = {container.restore("latest") for container in containers}
            if len(steps) != 1:
                raise SystemExit(f"chaos_trainer: ranks restored different steps {sorted(steps)}")
            step = steps.pop()
            progress("start", step=step, source="restore")
            return step
        except SessionLostError:
            raise
        except SwapStateError as e:  # a restart, a store outage: try again, bounded
            if time.monotonic() > deadline:
                raise
            progress("resume_retry", error=str(e)[:300])
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos_trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the server's address")
    parser.add_argument("--job", required=True, help="the job id")
    parser.add_argument("--ranks", type=int, default=1, help="ranks of the job, in lockstep in this process")
    parser.add_argument("--steps", type=int, required=True, help="the step to train up to")
    parser.add_argument("--snapshot-every", type=int, default=3, help="a snapshot every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="pace: at least this long per step")
    parser.add_argument("--progress", required=True, help="the JSON-lines file the chaos run reads")
    parser.add_argument("--stop-file", required=True, help="once this file exists, finish after the step")
    args = parser.parse_args(argv)
    progress = _Progress(args.progress)
    progress("launched")  # Python and torch imported
    models = [build(args.job) for _ in range(args.ranks)]
    containers = []
    try:
        for rank, model in enumerate(models):
            config = RemoteConfig(rank=rank, world_size=args.ranks, local_world_size=args.ranks, snapshot_model=True,
                                  server_wait_s=60.0, snapshot_replace_existing=True, rpc_timeout_s=10.0)
            containers.append(RemoteSwapOptimizersContainer([model], torch.optim.AdamW, {"lr": LR}, 2,
                                                            server=args.server, job_id=args.job, config=config))
        progress("attached")
        start = _resume(containers, args.job, progress, wait_s=120.0)
        pending: list = []
        last = start
        for step in range(start + 1, args.steps + 1):
            if os.path.exists(args.stop_file):
                break
            began = time.monotonic()
            last = step
            for model, container in zip(models, containers):
                _train_step(model, container, args.job, step)
            progress("step", step=step)
            if step % args.snapshot_every == 0:
                for rank, container in enumerate(containers):
                    try:
                        pending.append((rank, container.snapshot()))
                        progress("snapshot", step=step, rank=rank)
                    except SessionLostError:
                        raise
                    except SwapStateError as e:
                        progress("snapshot_not_taken", step=step, rank=rank, error=str(e)[:300])
            pending = [(rank, handle) for rank, handle in pending if not _settled(rank, handle, progress)]
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
        for rank, handle in pending:  # bounded: a snapshot that cannot complete says so
            try:
                handle.wait_durable(timeout_s=90.0)
                progress("durable", step=handle.step, rank=rank)
            except (SwapStateError, TimeoutError) as e:
                progress("snapshot_failed", step=handle.step, rank=rank, error=str(e)[:300])
        progress("done", step=last)
    finally:
        for container in containers:
            container.close()
    return 0


def _settled(rank: int, handle, progress: _Progress) -> bool:
    """Whether ``handle``'s snapshot is durable or failed now (recorded), without waiting."""
    try:
        state = handle.status(server_wait_s=0.0).state  # a poll: never waits for a restarting server
    except ServerUnavailableError:
        return False
    except SwapStateError as e:
        progress("snapshot_failed", step=handle.step, rank=rank, error=str(e)[:300])
        return True
    if state in ("durable", "stored"):
        progress("durable", step=handle.step, rank=rank)
        return True
    if state == "failed":
        progress("snapshot_failed", step=handle.step, rank=rank)
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
