"""End-to-end demo: a small model trained with RemoteSwapOptimizersContainer.

    python -m swap_state.client.demo                      # a local server is started for you
    python -m swap_state.client.demo --server unix:///run/swap-state/swap-state.sock \\
        --job-id demo --steps 20 --snapshot-every 5 --state-dir /tmp/demo

Prints every step, the bytes the server holds, and the step time next to plain fused AdamW
trained in the same run on the same data; ends by checking that parameters and moments are
bitwise equal to plain AdamW's.

Restarting: ``--state-dir`` keeps the model parameters of recent steps and of every snapshot
step, so a restarted trainer continues with ``--resume reattach`` (the server kept the
moments: within --grace), ``--resume latest`` (restore the latest snapshot) or ``--resume
auto`` (reattach, else latest, else from scratch).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from swap_state.client.remote.embedded import EmbeddedServerConfig

__all__ = ["DemoConfig", "TinyLM", "main", "run"]


@dataclasses.dataclass
class DemoConfig:
    server: str | None = None
    """Server address; None: $SWAP_STATE_SERVER, else a private local server."""
    job_id: str = "demo"
    """Job id (a restart with the same id and rank reattaches)."""
    steps: int = 10
    """Optimizer steps to reach (a resumed run continues up to this step)."""
    snapshot_every: int = 5
    """Take a server-side snapshot every N steps (0: never)."""
    resume: str = "none"
    """none | reattach | latest | auto."""
    state_dir: str | None = None
    """Where model parameters are kept for restarts; None: nowhere."""
    report: str | None = None
    """Write a JSON report (digests, step times, server bytes) here."""
    crash_after_step: int = 0
    """Test hook: SIGKILL this process right after step N is committed and saved."""
    swap_times: int = 4
    """Slices of the swap pipeline."""
    dim: int = 64
    """Model width."""
    layers: int = 2
    """Residual MLP blocks."""
    vocab: int = 256
    """Vocabulary (the embedding is tied to the output head)."""
    seed: int = 0
    """Initialisation and data seed."""
    token_file: str | None = None
    """Token for a server started with --token-file."""


class TinyLM(nn.Module):
    """Embedding -> residual MLP blocks -> tied output head."""

    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
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


def batch(cfg: DemoConfig, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    return torch.randint(0, cfg.vocab, (8, 33), generator=gen)


def train_step(model: nn.Module, optimizer, cfg: DemoConfig, step: int) -> float:
    tokens = batch(cfg, step)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
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
        h.update(named[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference_run(cfg: DemoConfig) -> tuple[str, list[float]]:
    """Plain fused AdamW from the same init on the same data: the digest to match."""
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIMIZER_KWARGS)
    _warm_up(cfg)
    times = []
    for step in range(1, cfg.steps + 1):
        start = time.perf_counter()
        train_step(model, optimizer, cfg, step)
        times.append(time.perf_counter() - start)
    names = {p: n for n, p in model.named_parameters()}
    moments = {
        f"{names[p]}.{k}": v for p, s in optimizer.state.items() for k, v in s.items() if k != "step"
    }
    return digest(model, moments), times


def _warm_up(cfg: DemoConfig) -> None:
    """Two throw-away steps so one-time costs (thread pools, allocations) time neither run."""
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIMIZER_KWARGS)
    for step in (1, 2):
        train_step(model, optimizer, cfg, step)


def _moments_of(container, model: nn.Module) -> dict[str, torch.Tensor]:
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for param, host in container.param_to_cpu_states_map.items():
        for key, value in host.items():
            if key != "step" and value is not None:
                out[f"{names[param]}.{key}"] = value
    return out


class ModelStore:
    """Model parameters by step under ``state_dir``: the last two steps (a reattach needs the
    step the server committed last) and the last few snapshot steps (a restore needs the
    snapshot's step), kept across restarts. Writes are atomic (temp file + rename)."""

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

    def _write(self, model: nn.Module, kind: str, step: int) -> None:
        tmp = self._path(kind, step) + ".tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, self._path(kind, step))

    def save(self, model: nn.Module, step: int, snapshot: bool = False) -> None:
        if not self.dir:
            return
        self._write(model, "step", step)
        if snapshot:
            self._write(model, "snap", step)
        for old in self._steps("step"):
            if old < step - 1:
                os.unlink(self._path("step", old))
        for old in self._steps("snap")[: -self.KEEP_SNAPSHOTS]:
            os.unlink(self._path("snap", old))

    def has(self, step: int) -> bool:
        return bool(self.dir) and any(os.path.exists(self._path(k, step)) for k in ("step", "snap"))

    def load(self, model: nn.Module, step: int) -> None:
        for kind in ("step", "snap"):
            if self.dir and os.path.exists(self._path(kind, step)):
                model.load_state_dict(torch.load(self._path(kind, step), weights_only=True))
                return
        raise SystemExit(
            f"demo: no model parameters for step {step} in --state-dir {self.dir!r}; cannot resume there"
        )


def _resume(container, cfg: DemoConfig, model: nn.Module, store: ModelStore) -> int:
    """Where a restarted demo continues: the server's kept moments when the model parameters
    of that step were saved too, else (``auto``/``latest``) the latest snapshot."""
    mode = cfg.resume
    if mode == "none":
        return 0
    kept = container.resumed_step
    if kept is not None and mode in ("reattach", "auto"):
        if store.has(kept):
            print(f"reattached: the server kept the moments of step {kept}")
            store.load(model, kept)
            return kept
        why = (
            f"the server kept the moments of step {kept}, but --state-dir has no model "
            "parameters of that step (the trainer died between its commit and its save)"
        )
        if mode == "reattach":
            raise SystemExit(f"demo: --resume reattach: {why}; --resume auto restores the latest snapshot")
        print(f"{why}: restoring the latest snapshot")
    elif mode == "reattach":
        if container._torn_step is not None:
            raise SystemExit(f"demo: --resume reattach: {container._torn_message()} (--resume auto does that)")
        raise SystemExit("demo: --resume reattach, but the server has no state for this job/rank")
    if _has_snapshot(container):
        step = container.restore("latest")
        print(f"restored the latest snapshot: step {step}")
        store.load(model, step)
        return step
    if mode == "latest" or kept is not None or container._torn_step is not None:
        raise SystemExit(
            f"demo: --resume {mode}: job {cfg.job_id!r} has no snapshot to restore; "
            "start over with a new --job-id"
        )
    return 0


def _segment_bytes(container) -> int:
    """Bytes of this trainer's segment on the server (moments, steps, header, spare slots)."""
    me = container.session.session_id
    return sum(s.segment_bytes for s in container.server_stats().sessions if s.session_id == me)


def _has_snapshot(container) -> bool:
    return bool(container.client.list_snapshots(container.remote_config.job_id).snapshots)


def run(cfg: DemoConfig) -> dict:
    from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer

    token = open(cfg.token_file).read().strip() if cfg.token_file else None
    reference_digest, plain_times = reference_run(cfg)
    model = build_model(cfg)
    with tempfile.TemporaryDirectory(prefix="swap-state-demo-") as scratch:
        container = RemoteSwapOptimizersContainer(
            [model],
            torch.optim.AdamW,
            dict(OPTIMIZER_KWARGS),
            cfg.swap_times,
            server=cfg.server,
            job_id=cfg.job_id,
            config=RemoteConfig(token=token, embedded=_embedded_config(cfg, scratch)),
        )
        return _train(cfg, container, model, reference_digest, plain_times)


def _embedded_config(cfg: DemoConfig, scratch: str) -> EmbeddedServerConfig:
    """A private server's snapshots go with the demo's state: under ``--state-dir`` (so a
    restarted demo restores them), else into a scratch folder removed at the end (the fixed
    job id ``demo`` would otherwise meet the previous run's snapshots of the same steps)."""
    root = os.path.join(cfg.state_dir, "snapshots") if cfg.state_dir else scratch
    return EmbeddedServerConfig(shm_size_bytes=None, snapshot_dir=root)


def _train(cfg: DemoConfig, container, model, reference_digest, plain_times) -> dict:
    where = container.remote_config.server
    if container._embedded is not None:
        where += " (a private server started for this demo)"
    print(f"swap-state-server: {where}")
    store = ModelStore(cfg.state_dir)
    start_step = _resume(container, cfg, model, store)
    handles = []
    times = []
    for step in range(start_step + 1, cfg.steps + 1):
        begin = time.perf_counter()
        loss = train_step(model, container, cfg, step)
        times.append(time.perf_counter() - begin)
        is_snapshot = bool(cfg.snapshot_every) and step % cfg.snapshot_every == 0
        # Parameters first: a snapshot is only useful with the parameters of its step.
        store.save(model, step, snapshot=is_snapshot)
        note = ""
        if is_snapshot:
            handles.append(container.snapshot())
            note = f"  snapshot {handles[-1].snapshot_id} (consistent)"
        held = _segment_bytes(container)
        print(f"step {step:4d}  loss {loss:.4f}  {times[-1] * 1e3:7.2f} ms  server holds {held / 2**20:.2f} MiB{note}")
        if step == cfg.crash_after_step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    for handle in handles:
        reply = handle.wait_durable()
        print(f"snapshot {handle.snapshot_id} durable at {reply.path}")
    result = _summarize(cfg, container, model, reference_digest, plain_times, times)
    container.close()
    return result


def _summarize(cfg, container, model, reference_digest, plain_times, times) -> dict:
    final = digest(model, _moments_of(container, model))
    stats = container.server_stats()
    plain_ms = statistics.median(plain_times) * 1e3
    remote_ms = statistics.median(times) * 1e3 if times else float("nan")
    print(f"median step: plain AdamW {plain_ms:.2f} ms, swap-state remote {remote_ms:.2f} ms "
          f"(ratio {remote_ms / plain_ms:.2f})")
    print(f"server budget used {stats.budget_used_bytes / 2**20:.2f} MiB of {stats.budget_total_bytes / 2**20:.0f} MiB")
    equal = final == reference_digest
    print("parameters and moments bitwise equal to plain AdamW:", "yes" if equal else "NO")
    result = {
        "step": cfg.steps,
        "digest": final,
        "reference_digest": reference_digest,
        "bitwise_equal": equal,
        "plain_step_ms": plain_ms,
        "remote_step_ms": remote_ms,
        "server_bytes": stats.budget_used_bytes,
    }
    if cfg.report:
        with open(cfg.report, "w") as f:
            json.dump(result, f, indent=2)
    return result


def parse_args(argv: list[str] | None) -> DemoConfig:
    parser = argparse.ArgumentParser(prog="python -m swap_state.client.demo", description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    for f in dataclasses.fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind = type(default) if default is not None else str
        kwargs = dict(default=default, help=f"(default: {default})")
        if f.name == "resume":
            kwargs["choices"] = ("none", "reattach", "latest", "auto")
        parser.add_argument(flag, type=kind, **kwargs)
    return DemoConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    from swap_state.client.remote.rpc import SwapStateError

    cfg = parse_args(argv)
    try:
        result = run(cfg)
    except SwapStateError as e:
        print(f"demo: swap-state failed: {e}", file=sys.stderr)
        return 2
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
