"""End-to-end demo: a small model trained with RemoteSwapOptimizersContainer.

    python -m swap_state.client.demo                      # a local server is started for you
    python -m swap_state.client.demo --server unix:///run/swap-state/swap-state.sock \\
        --job-id demo --steps 20 --snapshot-every 5 --state-dir /tmp/demo

Prints every step, the bytes the server holds, and the step time next to plain fused AdamW
on the same data; ends by checking that parameters and moments are bitwise equal to plain
AdamW's. A restarted demo continues with ``--state-dir`` and ``--resume`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from swap_state.client.device import host_bytes
from swap_state.client.errors import (
    ServerUnavailableError, SessionLostError, SnapshotFailedError, SnapshotNotFoundError, SwapStateError)
from swap_state.client.remote.config import RemoteConfig
from swap_state.client.remote.embedded import EmbeddedServerConfig, make_scratch_dir
from swap_state.common.errors import InvalidRequestError
from swap_state.common.names import parse_snapshot_id
from swap_state.common.server_flags import field_docs

__all__ = ["DemoConfig", "TinyLM", "main", "run"]

RESUME_MODES = ("none", "reattach", "latest", "auto")  # --resume besides a snapshot id


@dataclasses.dataclass
class DemoConfig:
    """The demo's settings; each field is a flag (``job_id`` -> ``--job-id``), its docstring the help."""

    server: str | None = None
    """the server's address (unix:///path or host:port); default: $SWAP_STATE_SERVER, else the
    host's server at the default socket, else a private server started for this demo"""
    job_id: str = "demo"
    """the job id (a restarted demo with the same id and rank reattaches to its state)"""
    steps: int = 10
    """the step to train up to (a resumed run trains from the step it resumed at)"""
    snapshot_every: int = 5
    """take a server-side snapshot every N steps (0: never)"""
    resume: str = "none"
    """how a restarted demo continues: none: from scratch; reattach: the optimizer state the
    server kept for this --job-id and rank (within the server's --grace); latest: restore the
    job's latest snapshot; auto: reattach, else latest, else from scratch; or a snapshot id to
    restore: demo/step-25, or step-25 of --job-id (step-000000000025 names the same one)"""
    state_dir: str | None = None
    """what a restart needs besides the server's state: the model parameters of its last two steps
    and last few snapshot steps, and a private server's snapshots. Every --resume but none needs it"""
    report: str | None = None
    """write a JSON report here (digests, step times, the server's bytes)"""
    crash_after_step: int = 0
    """a test hook: SIGKILL this process right after step N is committed and saved (0: never)"""
    step_seconds: float = 0.0
    """the least wall time of a step (the demo sleeps the rest), to act between steps (0: full speed)"""
    swap_times: int = 4
    """slices of the swap pipeline (the optimizer state moves slice by slice)"""
    dim: int = 64
    """the model's width"""
    layers: int = 2
    """residual MLP blocks"""
    vocab: int = 256
    """the vocabulary (the embedding is tied to the output head)"""
    seed: int = 0
    """the initialisation and data seed"""
    token_file: str | None = None
    """a file holding the token of a server started with --token-file"""
    server_wait: float = RemoteConfig.server_wait_s
    """seconds a snapshot waits for an unreachable (restarting) server; steps never wait"""


class TinyLM(nn.Module):
    """Embedding -> residual MLP blocks -> tied output head."""

    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight
        nn.init.normal_(self.embedding.weight, std=0.02)  # tied: keep the logits small

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(h)


OPTIMIZER_KWARGS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build_model(cfg: DemoConfig) -> TinyLM:
    torch.manual_seed(cfg.seed)
    return TinyLM(cfg.vocab, cfg.dim, cfg.layers)


def train_step(model: nn.Module, optimizer, cfg: DemoConfig, step: int) -> float:
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + step)  # the step's batch, the same in both runs
    tokens = torch.randint(0, cfg.vocab, (8, 33), generator=generator)
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def digest(model: nn.Module, moments: dict[str, torch.Tensor]) -> str:
    """sha256 of every parameter and moment's bytes, in name order."""
    h = hashlib.sha256()
    named = dict(model.named_parameters()) | {f"moment.{k}": v for k, v in moments.items()}
    for name in sorted(named):
        h.update(name.encode())
        h.update(host_bytes(named[name].detach().contiguous()))
    return h.hexdigest()


def reference_run(cfg: DemoConfig) -> tuple[str, list[float]]:
    """Plain fused AdamW from the same init on the same data: the digest to match, step times."""
    # Two throw-away steps first: one-time costs (thread pools, allocations) time neither run.
    for steps in ((1, 2), range(1, cfg.steps + 1)):
        model = build_model(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIMIZER_KWARGS)
        times = []
        for step in steps:
            start = time.perf_counter()
            train_step(model, optimizer, cfg, step)
            times.append(time.perf_counter() - start)
    return digest(model, _moments(model, optimizer.state)), times


def _moments(model: nn.Module, states: dict) -> dict[str, torch.Tensor]:
    """``<parameter name>.<key>`` of each optimizer state tensor but ``step``."""
    names = {p: n for n, p in model.named_parameters()}
    return {f"{names[p]}.{k}": v for p, state in states.items() for k, v in state.items()
            if k != "step" and v is not None}


class ModelStore:
    """Model parameters by step under ``state_dir``, written atomically: the last two steps (a
    reattach needs the server's last committed one) and the last few snapshot steps."""

    KEEP_SNAPSHOTS = 3  # more than the server's default --keep-latest 2

    def __init__(self, state_dir: str | None):
        self.dir = state_dir
        if state_dir:
            os.makedirs(state_dir, exist_ok=True)

    def _path(self, kind: str, step: int) -> str:
        return os.path.join(self.dir, f"model-{kind}-{step:08d}.pt")

    def _steps(self, kind: str) -> list[int]:
        prefix = f"model-{kind}-"
        names = (n for n in os.listdir(self.dir) if n.startswith(prefix) and n.endswith(".pt"))
        return sorted(int(n[len(prefix) : -3]) for n in names)

    def save(self, model: nn.Module, step: int, snapshot: bool = False) -> None:
        if not self.dir:
            return
        for kind in ("step", "snap") if snapshot else ("step",):
            tmp = self._path(kind, step) + ".tmp"
            torch.save(model.state_dict(), tmp)
            os.replace(tmp, self._path(kind, step))
        for old in self._steps("step"):
            if old < step - 1:
                os.unlink(self._path("step", old))

    def settle_snapshot(self, step: int, taken: bool) -> None:
        """After a snapshot's attempt: a step whose snapshot was not taken is no snapshot step
        (it must not push out the parameters of the snapshots that were); the last few kept."""
        if not self.dir:
            return
        if not taken:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path("snap", step))
        for old in self._steps("snap")[: -self.KEEP_SNAPSHOTS]:
            os.unlink(self._path("snap", old))

    def find(self, step: int) -> str | None:
        """The file of the parameters saved at ``step``; None when there is none."""
        paths = [self._path(kind, step) for kind in ("step", "snap")] if self.dir else []
        return next((path for path in paths if os.path.exists(path)), None)

    def require(self, mode: str) -> None:
        """Refuse to resume (``--resume mode``) without a --state-dir, saying what it is for."""
        if not self.dir:
            raise SystemExit(f"demo: --resume {mode}: --state-dir was not given: it keeps the model parameters of "
                             "the demo's recent and snapshot steps (the server holds only the optimizer state), "
                             "so a restarted demo needs the --state-dir of the run it continues; --resume none "
                             "starts over")

    def load(self, model: nn.Module, step: int, mode: str = "auto") -> None:
        self.require(mode)
        path = self.find(step)
        if path is None:
            raise SystemExit(f"demo: --resume {mode}: --state-dir {self.dir} has no model parameters of step {step} "
                             f"(it keeps the last two steps and the last {self.KEEP_SNAPSHOTS} snapshot steps of "
                             "the run that used it): was it another run's --state-dir?")
        model.load_state_dict(torch.load(path, weights_only=True))


def _resume(container, cfg: DemoConfig, model: nn.Module, store: ModelStore) -> tuple[int, str]:
    """The step a restarted demo continues from, and from what (as ``--resume`` says)."""
    mode = cfg.resume
    if mode == "none":
        return 0, "a fresh start"
    if mode not in RESUME_MODES:
        return _restore(container, cfg, model, store, mode)
    kept = container.resumed_step
    if kept is not None and mode in ("reattach", "auto"):
        if store.find(kept) or not store.dir:  # without --state-dir, load says what it is for
            store.load(model, kept, mode)
            print(f"reattached: the server kept the moments of step {kept}")
            return kept, "the moments the server kept"
        why = (f"the server kept the moments of step {kept}, but --state-dir has no model parameters of that step "
               "(the trainer died between its commit and its save)")
        if mode == "reattach":
            raise SystemExit(f"demo: --resume reattach: {why}; --resume auto restores the latest snapshot")
        print(f"{why}: restoring the latest snapshot")
    elif mode == "reattach":
        raise SystemExit(_nothing_to_reattach(container, cfg))
    listed = container.client.list_snapshots(container.remote_config.job_id)
    if listed.snapshots:
        return _restore(container, cfg, model, store, "latest")  # fails naming a store it cannot read
    if listed.store_error:  # no snapshot here, and the store, which may hold some, unread: never start over
        raise SystemExit(f"demo: --resume {mode}: job {cfg.job_id!r} has no snapshot on this server, and the "
                         f"snapshot store could not be read ({listed.store_error}): it may hold this job's "
                         "snapshots. Fix the store and run again; --resume none starts over")
    if mode == "latest" or kept is not None or container.segment.torn_step is not None:
        raise SystemExit(f"demo: --resume {mode}: job {cfg.job_id!r} has no snapshot to restore; "
                         "start over with a new --job-id")
    return 0, "a fresh start"


def _restore(container, cfg: DemoConfig, model: nn.Module, store: ModelStore, snapshot_id: str) -> tuple[int, str]:
    """Restore ``snapshot_id`` (``latest``, or an id in either spelling) and its step's parameters."""
    store.require(cfg.resume)
    step = container.restore(snapshot_id)
    named = f"{parse_snapshot_id(snapshot_id, cfg.job_id).job_id}/step-{step}"
    print(f"restored {'the latest snapshot' if snapshot_id == 'latest' else 'snapshot ' + named}: step {step}")
    store.load(model, step, cfg.resume)
    return step, f"snapshot {named}"


def _nothing_to_reattach(container, cfg: DemoConfig) -> str:
    """``--resume reattach`` and the server kept nothing usable: why, and what to do instead."""
    if container.segment.torn_step is not None:
        return f"demo: --resume reattach: {container.segment.torn_message()} (--resume auto does that)"
    why = container.session.previous_session or (
        "it holds none (a restarted server, a first run of this --job-id, or more than the "
        "server's --grace seconds since the last trainer of this job went away)")
    return (f"demo: --resume reattach: the server has no state for job {cfg.job_id!r} rank {container.session.rank}: "
            f"{why}. Restore a snapshot instead (--resume latest, or --resume auto: reattach, else restore), or "
            "start the server with a longer --grace so that a restarted trainer finds its state")


def run(cfg: DemoConfig) -> dict:
    from swap_state.client.remote.container import RemoteSwapOptimizersContainer

    token = open(cfg.token_file).read().strip() if cfg.token_file else None
    model = build_model(cfg)
    # A scratch folder of a demo killed on purpose (--crash-after-step) is swept by the next.
    scratch = make_scratch_dir("swap-state-demo-")
    # A private server's snapshots: under --state-dir (a restarted demo restores them), else in
    # the scratch folder (the fixed job id would otherwise meet a previous run's snapshots).
    snapshot_dir = os.path.join(cfg.state_dir, "snapshots") if cfg.state_dir else scratch
    embedded = EmbeddedServerConfig(shm_size_bytes=None, snapshot_dir=snapshot_dir)
    try:
        # A resumed demo trains steps again: its snapshots replace an earlier run's of those
        # steps (as torchtitan's checkpoints do).
        container = RemoteSwapOptimizersContainer(
            [model], torch.optim.AdamW, dict(OPTIMIZER_KWARGS), cfg.swap_times, server=cfg.server,
            job_id=cfg.job_id,
            config=RemoteConfig(token=token, embedded=embedded, snapshot_replace_existing=True,
                                server_wait_s=cfg.server_wait))
        where = container.remote_config.server
        if container.segment.embedded is not None:
            where += " (a private server started for this demo)"
        print(f"swap-state-server: {where}")
        # After the attach: a wrong address fails before a second is spent on the reference.
        reference_digest, plain_times = reference_run(cfg)
        store = ModelStore(cfg.state_dir)
        start_step, source = _resume(container, cfg, model, store)
        _check_steps_left(cfg, start_step, source)
        handles: list = []
        times: list[float] = []
        try:
            _steps(cfg, container, model, store, start_step, handles, times)
        except KeyboardInterrupt:  # Ctrl-C: one line that says what is kept and how to resume
            print(_interrupted(cfg, container), file=sys.stderr)
            raise SystemExit(130) from None
        _report_durable(handles)
        result = _summarize(cfg, container, model, reference_digest, plain_times, times)
        container.close()
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _interrupted(cfg: DemoConfig, container) -> str:
    """Detach, keeping the state on a host's server; say what is kept and how to resume."""
    job, done = container.remote_config.job_id, container.session.last_committed_step
    private = container.segment.embedded is not None
    container.close(keep=not private)
    kept, how = "its private server stopped with it, so only its snapshots are kept", "--resume latest"
    if not private:
        kept = (f"the server at {container.remote_config.server} keeps the optimizer state of job {job} "
                "for its --grace seconds")
        how = "--resume auto (reattach, else the latest snapshot)"
    again = (f"rerun with --job-id {job} --state-dir {cfg.state_dir} {how}" if cfg.state_dir
             else "a rerun can resume only with --state-dir (it keeps the model's parameters)")
    after = "before its first step" if done is None else f"after step {done}"
    return f"demo: interrupted {after}: {kept}; {again}"


def _steps(cfg: DemoConfig, container, model, store, start_step: int, handles: list, times: list) -> None:
    """Train from ``start_step`` to ``cfg.steps``, appending the snapshots taken and the step times."""
    for step in range(start_step + 1, cfg.steps + 1):
        begin = time.perf_counter()
        loss = train_step(model, container, cfg, step)
        times.append(time.perf_counter() - begin)
        is_snapshot = bool(cfg.snapshot_every) and step % cfg.snapshot_every == 0
        # Parameters first: a snapshot is only useful with the parameters of its step.
        store.save(model, step, snapshot=is_snapshot)
        note = ""
        if is_snapshot:
            note = _snapshot(container, step, handles)
            store.settle_snapshot(step, taken=bool(handles) and handles[-1].step == step)
        me = container.session.session_id
        try:  # the bytes of this trainer's segment on the server (not waited for: steps never wait)
            held = sum(s.segment_bytes for s in container.server_stats().sessions if s.session_id == me)
            holds = f"server holds {held / 2**20:.2f} MiB"
        except SwapStateError:
            holds = "server unreachable (restarting?)"
        print(f"step {step:4d}  loss {loss:.4f}  {times[-1] * 1e3:7.2f} ms  {holds}{note}")
        if step == cfg.crash_after_step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(max(0.0, cfg.step_seconds - (time.perf_counter() - begin)))


def _snapshot(container, step: int, handles: list) -> str:
    """Take a snapshot (a restarting server is waited for, ``--server-wait``); one the server
    cannot take now is said and training goes on: the next one is tried as usual."""
    try:
        handles.append(container.snapshot())
    except SessionLostError:
        raise  # the state is gone: nothing to train on
    except SwapStateError as e:  # unreachable past --server-wait, a full disk, ...
        print(f"snapshot of step {step} not taken: {e}", file=sys.stderr)
        return "  snapshot not taken (see stderr)"
    return f"  snapshot {handles[-1].snapshot_id} (consistent)"


def _report_durable(handles: list) -> None:
    """Wait until each snapshot is durable and say where, or the server's reason why not."""
    for handle in handles:
        try:
            print(f"snapshot {handle.snapshot_id} durable at {handle.wait_durable().path}")
        except ServerUnavailableError as e:
            print(f"snapshot {handle.snapshot_id}: not confirmed durable: {e}")
        except (SnapshotNotFoundError, SnapshotFailedError) as e:
            # The server's words in the client error: after "NOT_FOUND: " and the like.
            text = str(e)
            reason = next((text.split(code, 1)[1] for code in ("NOT_FOUND: ", "FAILED_PRECONDITION: ", "failed: ")
                           if code in text), text)
            what = "is not on the server" if isinstance(e, SnapshotNotFoundError) else "failed"
            print(f"snapshot {handle.snapshot_id} {what}: {reason}")


def _check_steps_left(cfg: DemoConfig, start_step: int, source: str) -> None:
    """A resumed state past ``--steps`` has nothing to train nor compare with: say so."""
    if start_step > cfg.steps:
        raise SystemExit(f"demo: nothing left to train: the run resumed at step {start_step} ({source}) and "
                         f"--steps {cfg.steps} is the step to reach; give --steps above {start_step} to train on")
    if start_step == cfg.steps and start_step:
        print(f"nothing left to train: resumed at step {start_step} = --steps ({source}); "
              "checking the state against plain AdamW's")


def _summarize(cfg, container, model, reference_digest, plain_times, times) -> dict:
    final = digest(model, _moments(model, container.param_to_cpu_states_map))
    try:
        stats = container.server_stats(wait_s=cfg.server_wait)  # a server restarted meanwhile
    except ServerUnavailableError as e:  # gone for good: the run's own result still counts
        stats = None
        print(f"server budget: unknown ({e})", file=sys.stderr)
    plain_ms = statistics.median(plain_times) * 1e3
    remote_ms = statistics.median(times) * 1e3 if times else None
    if remote_ms is None:
        print(f"median step: plain AdamW {plain_ms:.2f} ms; swap-state remote: no step trained in this run")
    else:
        print(f"median step: plain AdamW {plain_ms:.2f} ms, swap-state remote {remote_ms:.2f} ms "
              f"(ratio {remote_ms / plain_ms:.2f})")
    if stats is not None:
        print(f"server budget used {stats.budget_used_bytes / 2**20:.2f} MiB of {stats.budget_total_bytes / 2**20:.0f} MiB")
    equal = final == reference_digest
    print("parameters and moments bitwise equal to plain AdamW:", "yes" if equal else "NO")
    result = {"step": cfg.steps, "digest": final, "reference_digest": reference_digest,
              "bitwise_equal": equal, "plain_step_ms": plain_ms, "remote_step_ms": remote_ms,
              "server_bytes": stats.budget_used_bytes if stats is not None else None}
    if cfg.report:
        with open(cfg.report, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _resume_arg(text: str) -> str:
    if text in RESUME_MODES:
        return text
    try:
        parse_snapshot_id(text, "job")  # the form only: --job-id may come later
    except InvalidRequestError:
        raise argparse.ArgumentTypeError(f"{text!r} is none of {', '.join(RESUME_MODES)}, nor a snapshot id such as "
                                         "demo/step-25 (or demo/step-000000000025) or step-25") from None
    return text


def parse_args(argv: list[str] | None) -> DemoConfig:
    parser = argparse.ArgumentParser(prog="python -m swap_state.client.demo", description=__doc__.split("\n\n")[0])
    docs, defaults = field_docs(DemoConfig), DemoConfig()
    for f in dataclasses.fields(DemoConfig):
        default = getattr(defaults, f.name)
        kind = _resume_arg if f.name == "resume" else str if default is None else type(default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default,
                            help=f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%"))
    return DemoConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        result = run(cfg)
    except SwapStateError as e:
        print(f"demo: swap-state failed: {e}", file=sys.stderr)
        return 2
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
