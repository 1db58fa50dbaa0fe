"""torchtitan's own trainer on the CPU (``tests/torchtitan/launcher.py``), observed for
:mod:`bench.titan_checkpoint`: what ``CheckpointManager.save`` costs the training loop.

    python bench/titan_trainer.py [torchtitan flags ...]

Run in place of the launcher, with the launcher's environment (``titan_testkit.launch``
builds it) plus:

* ``SWAP_STATE_BENCH_RECORD=path``: JSON lines appended as they happen (``time.monotonic()``
  seconds, this process's clock):

  - ``{"kind": "state", ...}`` once, after the trainer is built: parameter count and bytes,
    the optimizer class, whether the optimizer is swap-state's remote container;
  - ``{"kind": "step", "step", "t0", "t1"}`` per ``Trainer.train_step``;
  - ``{"kind": "save", "step", "last", "saves", "t0", "t1"}`` per call of the trainer's
    ``checkpointer.save`` (``saves``: ``_should_save`` was true, so it saved or staged), timed
    around the call the training loop makes (outside every wrapper, swap-state's included);
  - ``{"kind": "durable", "step", "t", ...}`` when what that save started in the background is
    done: the DCP ``async_save`` future (``async_mode = "async"``), or, in snapshot mode, the
    server's snapshot the checkpoint refers to (its ``wait_durable``, polled from a thread),
    with the snapshot's final counts (copy-before-write copies, back-pressure waits and
    seconds, chunks the server staged) and the server's copy-slot budget for the session;
  - ``{"kind": "end", "t", "peak_rss_bytes", "cpu_s"}`` once the trainer is done (this process).

* ``SWAP_STATE_BENCH_FLAVORS='{"name": {TransformerModelArgs kwargs}, ...}'``: llama3 flavors
  added to ``torchtitan.models.llama3.llama3_args`` before the job config is read, for
  ``--model.flavor=name`` (model sizes between debugmodel and 8B).

Nothing here changes what the trainer computes or saves.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD_ENV = "SWAP_STATE_BENCH_RECORD"
FLAVORS_ENV = "SWAP_STATE_BENCH_FLAVORS"

_lock = threading.Lock()


def _record(path: str, event: dict) -> None:
    if not path:
        return
    with _lock, open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def _register_flavors(spec: str) -> list[str]:
    if not spec:
        return []
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    flavors = json.loads(spec)
    for name, kwargs in flavors.items():
        llama3_args[name] = TransformerModelArgs(**kwargs)
    return list(flavors)


_SNAPSHOT_FIELDS = ("bytes_total", "cow_copies", "trainer_copied_bytes", "backpressure_waits",
                    "backpressure_wait_seconds", "server_staged_chunks", "server_staged_bytes")
_SESSION_FIELDS = ("copy_slot_bytes", "copy_budget_needed_bytes", "copy_budget_warning")


def _session_budget(optimizers) -> dict:
    """The server's view of this trainer's copy-before-write slots (whole-state snapshots)."""
    try:
        stats = optimizers.server_stats()
        job = optimizers.remote_config.job_id
        for s in stats.sessions:
            if s.job_id == job:
                return {k: getattr(s, k) for k in _SESSION_FIELDS if hasattr(s, k)}
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"error": repr(e)}
    return {}


def _watch_durable(record_path: str, step: int, handle, optimizers) -> None:
    """Record when the server's snapshot of a save is durable, with its copy-before-write and
    back-pressure counts (what the trainer's steps paid while it persisted)."""

    def run() -> None:
        event = {"kind": "durable", "step": step, "source": "snapshot"}
        try:
            reply = handle.wait_durable()
            event["t"] = time.monotonic()
            event.update({k: getattr(reply, k) for k in _SNAPSHOT_FIELDS if hasattr(reply, k)})
            event["session"] = _session_budget(optimizers)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the run goes on
            event.update({"t": time.monotonic(), "error": repr(e)})
        _record(record_path, event)

    threading.Thread(target=run, name=f"bench-durable-{step}", daemon=True).start()


def _optimizer_info(optimizers) -> dict:
    cls = type(optimizers)
    inner = getattr(optimizers, "optimizers", None) or []
    return {
        "container": f"{cls.__module__}.{cls.__qualname__}",
        "optimizer": type(inner[0]).__name__ if inner else "",
        "swap_state_remote": hasattr(optimizers, "checkpoint_reference"),
        "snapshots_model": bool(getattr(optimizers, "snapshots_model", False)),
        "checkpoint_mode": getattr(getattr(optimizers, "remote_config", None), "checkpoint", None),
    }


def make_bench_trainer(base_cls, record_path: str):
    class BenchTrainer(base_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            params = [p for part in self.model_parts for p in part.parameters()]
            n = sum(p.numel() for p in params)
            nbytes = sum(p.numel() * p.element_size() for p in params)
            _record(record_path, {
                "kind": "state", "params": n, "param_bytes": nbytes,
                # AdamW's exp_avg and exp_avg_sq, in the parameters' dtype (fp32 here).
                "moment_bytes": 2 * nbytes,
                "torch_threads": __import__("torch").get_num_threads(),
                **_optimizer_info(self.optimizers),
            })  # fmt: skip
            checkpointer = self.checkpointer
            original = checkpointer.save

            def save(curr_step, last_step=False):
                saves = bool(checkpointer._should_save(curr_step, last_step))
                t0 = time.monotonic()
                try:
                    return original(curr_step, last_step=last_step)
                finally:
                    t1 = time.monotonic()
                    _record(record_path, {"kind": "save", "step": curr_step, "last": bool(last_step),
                                          "saves": saves, "t0": t0, "t1": t1})
                    if saves:
                        self._watch_background(curr_step)

            checkpointer.save = save

        def _watch_background(self, step: int) -> None:
            future = getattr(self.checkpointer, "save_future", None)
            if future is not None and hasattr(future, "add_done_callback"):
                future.add_done_callback(
                    lambda f: _record(record_path, {"kind": "durable", "step": step, "t": time.monotonic(),
                                                    "source": "async_save"})
                )
                return
            handle = getattr(self.optimizers, "_checkpoint_snapshot", None)
            if handle is not None and getattr(handle, "step", None) is not None:
                _watch_durable(record_path, step, handle, self.optimizers)

        def train_step(self, data_iterator):
            t0 = time.monotonic()
            try:
                return super().train_step(data_iterator)
            finally:
                _record(record_path, {"kind": "step", "step": self.step, "t0": t0, "t1": time.monotonic()})

    return BenchTrainer


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    sys.path.insert(0, str(REPO / "tests" / "torchtitan"))
    import launcher  # tests/torchtitan/launcher.py: torchtitan's Trainer on the CPU

    record_path = os.environ.get(RECORD_ENV, "")
    launcher.set_torchrun_env()
    tt_train = launcher.import_torchtitan_on_cpu()
    _register_flavors(os.environ.get(FLAVORS_ENV, ""))
    try:
        tt_train.main(make_bench_trainer(launcher.make_trainer_class(tt_train), record_path))
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _record(record_path, {"kind": "end", "t": time.monotonic(), "peak_rss_bytes": usage.ru_maxrss * 1024,
                              "cpu_s": usage.ru_utime + usage.ru_stime})


if __name__ == "__main__":
    main()
