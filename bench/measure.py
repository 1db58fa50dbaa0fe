"""The measurements of one state size, on variants built by :mod:`bench.workload`."""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.hardware import drop_tree_cache, write_read_once
from bench.util import cpu_jiffies, gbps, median_ci, proc_status, summarize
from bench.workload import Variant

__all__ = ["checkpoint_stalls", "commit_latency", "memory", "restore_throughput", "snapshot_overlap"]


def _counters(reply: Any) -> dict[str, float]:
    return {
        "cow_copies": int(reply.cow_copies),
        "backpressure_waits": int(reply.backpressure_waits),
        "backpressure_wait_s": float(reply.backpressure_wait_seconds),
        "trainer_copied_bytes": int(getattr(reply, "trainer_copied_bytes", 0)),
        "server_staged_bytes": int(getattr(reply, "server_staged_bytes", 0)),
        "server_staged_chunks": int(getattr(reply, "server_staged_chunks", 0)),
    }


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` so far (NaN when unreadable)."""
    if pid is None:
        return float("nan")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def snapshot_overlap(remote: Variant, target_steps: int, max_seconds: float, server_pid: int | None = None) -> dict[str, Any]:
    """Step time while a snapshot persists vs without, on the remote container.

    Repeats: ``snapshot()`` (its own cost is the stall, measured elsewhere), then steps until
    the snapshot is durable (a step counts as "with" when the snapshot was not yet durable as
    it began; the status poll is outside the timed step), then as many steps without a
    snapshot. Copy-before-write and back-pressure counts, the trainer's and the server's
    copied bytes are the SnapshotStatus reply's. Unary RPCs are counted inside the timed
    steps only (the bench's own status polls and snapshot() calls are not the trainer's step).
    """
    container = remote.optimizer
    with_train, with_opt, without_train, without_opt = [], [], [], []
    first_train, first_opt, stall = [], [], []
    totals = {"cow_copies": 0, "backpressure_waits": 0, "backpressure_wait_s": 0.0,
              "trainer_copied_bytes": 0, "server_staged_bytes": 0, "server_staged_chunks": 0}
    rpc = remote.rpc
    if rpc is not None:
        rpc.enabled = False
        rpc.reset()

    def step() -> tuple[float, float]:
        if rpc is not None:
            rpc.enabled = True
        try:
            return remote.step()
        finally:
            if rpc is not None:
                rpc.enabled = False

    durable_s: list[float] = []
    steps_per_snapshot: list[int] = []
    paired: dict[str, list[float]] = {"train": [], "opt": []}
    snapshots = 0
    deadline = time.monotonic() + max_seconds
    persisting_wall = 0.0
    persisting_cpu = 0.0
    # Machine-wide busy CPU (trainer, server, kernel writeback, everyone else) per phase.
    busy = {"with": [0.0, 0.0], "without": [0.0, 0.0]}  # [cpu seconds, wall seconds]

    def account(phase: str, since: tuple[dict[str, float], float]) -> tuple[dict[str, float], float]:
        now = (cpu_jiffies(), time.perf_counter())
        if since[0] and now[0]:
            busy[phase][0] += now[0]["busy"] - since[0]["busy"]
            busy[phase][1] += now[1] - since[1]
        return now

    while len(with_train) < target_steps and time.monotonic() < deadline:
        cpu0 = _cpu_seconds(server_pid)
        mark = (cpu_jiffies(), time.perf_counter())
        t0 = time.perf_counter()
        handle = container.snapshot()
        stall.append(time.perf_counter() - t0)
        n = 0
        while True:
            reply = handle.status(0.0)
            if reply.state == "failed":
                raise RuntimeError(f"snapshot {handle.snapshot_id} failed: {reply.error}")
            if reply.state == "durable":
                break
            train, opt = step()
            with_train.append(train)
            with_opt.append(opt)
            if n == 0:
                first_train.append(train)
                first_opt.append(opt)
            n += 1
        durable_s.append(time.perf_counter() - t0)
        mark = account("with", mark)
        persisting_wall += durable_s[-1]
        persisting_cpu += _cpu_seconds(server_pid) - cpu0
        snapshots += 1
        steps_per_snapshot.append(n)
        for key, value in _counters(reply).items():
            totals[key] += value
        for _ in range(max(1, n)):
            train, opt = step()
            without_train.append(train)
            without_opt.append(opt)
        account("without", mark)
        if n:  # this snapshot's steps against the steps right after it
            m = max(1, n)
            for kind, w, wo in (("train", with_train, without_train), ("opt", with_opt, without_opt)):
                paired[kind].append(statistics.fmean(w[-n:]) / statistics.fmean(wo[-m:]))
    steps_timed = len(with_train) + len(without_train)
    rpcs = {name: count / steps_timed for name, count in rpc.counts.items()} if rpc is not None and steps_timed else {}
    without_opt_mean = statistics.fmean(without_opt) if without_opt else float("nan")
    without_train_mean = statistics.fmean(without_train) if without_train else float("nan")
    return {
        "snapshots": snapshots,
        "steps_with": len(with_train),
        "first_step_after_snapshot_train_s": summarize(first_train),
        "first_step_after_snapshot_opt_s": summarize(first_opt),
        "snapshot_call_s": summarize(stall),
        "ratio_opt": {
            "mean": statistics.fmean(with_opt) / without_opt_mean if with_opt else float("nan"),
            "p99": (summarize(with_opt).get("p99", float("nan")) / without_opt_mean) if with_opt else float("nan"),
            "max": max(with_opt) / without_opt_mean if with_opt else float("nan"),
        },
        "ratio_train": {
            "mean": statistics.fmean(with_train) / without_train_mean if with_train else float("nan"),
            "p99": (summarize(with_train).get("p99", float("nan")) / without_train_mean) if with_train else float("nan"),
            "max": max(with_train) / without_train_mean if with_train else float("nan"),
        },
        "unary_rpcs_per_step": rpcs,
        "steps_without": len(without_train),
        "steps_per_snapshot": steps_per_snapshot,
        "with_train_s": summarize(with_train),
        "with_opt_s": summarize(with_opt),
        "without_train_s": summarize(without_train),
        "without_opt_s": summarize(without_opt),
        "snapshot_to_durable_while_training_s": summarize(durable_s),
        "paired_ratio_train": {**summarize(paired["train"]), "ci95": list(median_ci(paired["train"]))},
        "paired_ratio_opt": {**summarize(paired["opt"]), "ci95": list(median_ci(paired["opt"]))},
        "server_cpu_s_per_s": persisting_cpu / persisting_wall if persisting_wall else float("nan"),
        "machine_busy_cpu_s_per_s_with": busy["with"][0] / busy["with"][1] if busy["with"][1] else float("nan"),
        "machine_busy_cpu_s_per_s_without": busy["without"][0] / busy["without"][1] if busy["without"][1] else float("nan"),
        **totals,
        "raw": {"with_train": with_train, "without_train": without_train, "with_opt": with_opt, "without_opt": without_opt},
    }


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fresh(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        os.unlink(path)
    os.sync()  # earlier writes' writeback must not land in the next measurement


def checkpoint_stalls(inproc: Variant, remote: Variant, work_dir: str, reps: int) -> dict[str, Any]:
    """Trainer-visible stall and time-to-durable of one optimizer state, four ways.

    torch.save / DCP save / DCP async_save get the in-process swap container's
    ``state_dict()`` (the seed's flat dict: every moment, views of the host cache, plus steps
    and param groups): the bytes a torchtitan checkpoint of it carries. swap-state gets the
    remote container's ``snapshot()``: the same moments, already in the server's memory.
    """
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    state = inproc.optimizer.state_dict()
    state_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    results: dict[str, dict[str, list[float]]] = {
        m: {"stall": [], "durable": []} for m in ("torch_save", "dcp_save", "dcp_async_save", "swap_state")
    }
    metadata_s: list[float] = []
    disk_ref: dict[str, list[float]] = {}
    snapshot_bytes: list[int] = []
    snapshot_ids: list[str] = []
    os.makedirs(work_dir, exist_ok=True)
    rpc = remote.rpc
    if rpc is not None:  # times the Snapshot RPC itself, inside snapshot()
        rpc.reset()
        rpc.enabled = True
    def disk_reference() -> None:
        # The disk's own rate for the same byte count, at the same moment: right before and
        # right after each snapshot. It drifts on a shared or virtual disk, and sustained
        # writes slow this one down (measured: 512 MiB O_DIRECT files written back to back
        # went from 1.6 to 1.1 GB/s), so a reference taken before the other checkpoint
        # methods wrote theirs would flatter the disk against the snapshot that follows them.
        _fresh(os.path.join(work_dir, "disk-ref.bin"))
        for key, value in write_read_once(os.path.join(work_dir, "disk-ref.bin"), state_bytes).items():
            disk_ref.setdefault(key + "_gbps", []).append(value)

    for rep in range(reps):

        # torch.save returns once the bytes are in the page cache; durable needs an fsync,
        # which the trainer would also have to wait for.
        path = os.path.join(work_dir, "torch_save.pt")
        _fresh(path)
        t0 = time.perf_counter()
        torch.save(state, path)
        t1 = time.perf_counter()
        _fsync_path(path)
        _fsync_path(work_dir)
        t2 = time.perf_counter()
        results["torch_save"]["stall"].append(t1 - t0)
        results["torch_save"]["durable"].append(t2 - t0)
        _fresh(path)

        # DCP save blocks until written and fsynced (FileSystemWriter sync_files=True).
        path = os.path.join(work_dir, "dcp_save")
        _fresh(path)
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path, no_dist=True)
        t1 = time.perf_counter()
        results["dcp_save"]["stall"].append(t1 - t0)
        results["dcp_save"]["durable"].append(t1 - t0)
        _fresh(path)

        # DCP async_save blocks while it stages a copy, then writes in the background.
        path = os.path.join(work_dir, "dcp_async")
        _fresh(path)
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path, no_dist=True)
        t1 = time.perf_counter()
        upload = getattr(future, "upload_completion", future)
        upload.result()
        t2 = time.perf_counter()
        results["dcp_async_save"]["stall"].append(t1 - t0)
        results["dcp_async_save"]["durable"].append(t2 - t0)
        del future, upload
        _fresh(path)

        # swap-state: a new committed step, then the trainer's one call.
        remote.step()
        t0 = time.perf_counter()
        remote.optimizer.snapshot_metadata()  # the part of snapshot() done in the trainer
        metadata_s.append(time.perf_counter() - t0)
        disk_reference()
        os.sync()
        t0 = time.perf_counter()
        handle = remote.optimizer.snapshot()
        t1 = time.perf_counter()
        reply = handle.wait_durable()
        t2 = time.perf_counter()
        disk_reference()
        results["swap_state"]["stall"].append(t1 - t0)
        results["swap_state"]["durable"].append(t2 - t0)
        snapshot_bytes.append(int(reply.bytes_total))
        snapshot_ids.append(handle.snapshot_id)
    out: dict[str, Any] = {
        "state_dict_tensor_bytes": state_bytes,
        "reps": reps,
        "disk_ref": {key: summarize(values) for key, values in disk_ref.items()},
    }
    for method, samples in results.items():
        out[method] = {
            "stall_s": summarize(samples["stall"]),
            "durable_s": summarize(samples["durable"]),
            "raw": samples,
        }
    persist = [gbps(b, t) for b, t in zip(snapshot_bytes, results["swap_state"]["durable"])]
    out["swap_state"]["bytes_total"] = snapshot_bytes[-1] if snapshot_bytes else 0
    out["swap_state"]["persist_gbps"] = summarize(persist)
    out["swap_state"]["snapshot_ids"] = snapshot_ids
    out["swap_state"]["metadata_s"] = summarize(metadata_s)
    if rpc is not None:
        rpc.enabled = False
        out["swap_state"]["snapshot_rpc_s"] = summarize(rpc.latency.get("Snapshot", []))
    return out


def _cold_read(paths: list[str], snapshot_dir: str, direct: bool = False) -> float:
    """Seconds to read ``paths`` sequentially (8 MiB reads) with their pages dropped first;
    ``direct``: with O_DIRECT (the disk's own limit; raises OSError where refused)."""
    drop_tree_cache(snapshot_dir)
    buffer = mmap.mmap(-1, 8 << 20)  # page aligned, as O_DIRECT needs
    block = memoryview(buffer)
    try:
        t0 = time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                while os.readv(fd, [block]) > 0:
                    pass
            finally:
                os.close(fd)
        return time.perf_counter() - t0
    finally:
        block.release()
        buffer.close()


def restore_throughput(remote: Variant, new_trainer: Callable[[], Any], snapshot_id: str, snapshot_dir: str,
                       nbytes: int, reps: int) -> dict[str, Any]:
    """``container.restore(id)`` as the trainer sees it, two ways:

    * a new trainer's (``new_trainer()``: a container of the job, no step taken), its segment
      holding nothing: the server copies each tensor into it as soon as it is verified, while
      it reads the next ones. Cold (the snapshot's pages dropped first); each closed after, so
      the next one is new too.
    * the running trainer's (``remote``), its segment holding a committed step: the server copies
      the kept bytes aside (the segment's copy slots), reads the file once and copies it in as
      verified, putting them back on a failure (a corrupt snapshot leaves the state as it was).
      Cold and warm (just read: O_DIRECT reads bypass the page cache, so about as cold).

    Next to each cold restore, a plain cold read and an O_DIRECT read of the same files (same
    disk, same moment): the references. ``remote`` is closed after (the job's one trainer)."""
    container = remote.optimizer
    job, _, step = snapshot_id.partition("/step-")
    step_dir = os.path.join(snapshot_dir, job, f"step-{int(step):012d}")
    files = sorted(os.path.join(step_dir, f) for f in os.listdir(step_dir) if f.endswith(".safetensors"))
    file_bytes = sum(os.path.getsize(f) for f in files)
    cold, warm, read, direct_read = [], [], [], []
    for _ in range(reps):
        _references(files, snapshot_dir, read, direct_read)
        cold.append(_timed_restore(container, snapshot_id, snapshot_dir))
        warm.append(_timed_restore(container, snapshot_id, None))
    container.close()
    new, new_direct_read = [], []
    for _ in range(reps):
        trainer = new_trainer()
        try:
            _references(files, snapshot_dir, None, new_direct_read)
            new.append(_timed_restore(trainer, snapshot_id, snapshot_dir))
        finally:
            trainer.close()
    return {
        "snapshot_id": snapshot_id,
        "bytes": nbytes,
        "cold_s": summarize(cold),
        "warm_s": summarize(warm),
        "cold_gbps": summarize([gbps(nbytes, t) for t in cold]),
        "warm_gbps": summarize([gbps(nbytes, t) for t in warm]),
        "file_cold_read_gbps": summarize([gbps(file_bytes, t) for t in read]),
        "file_direct_read_gbps": summarize([gbps(file_bytes, t) for t in direct_read]),
        "new_trainer_gbps": summarize([gbps(nbytes, t) for t in new]),
        "new_trainer_file_direct_read_gbps": summarize([gbps(file_bytes, t) for t in new_direct_read]),
    }


def _references(files: list[str], snapshot_dir: str, read: list[float] | None, direct_read: list[float]) -> None:
    """A cold buffered read of ``files`` into ``read`` (unless None), an O_DIRECT one into ``direct_read``."""
    if read is not None:
        read.append(_cold_read(files, snapshot_dir))
    try:
        direct_read.append(_cold_read(files, snapshot_dir, direct=True))
    except OSError:
        pass  # no O_DIRECT on this filesystem: the buffered read is the reference


def _timed_restore(container: Any, snapshot_id: str, drop_dir: str | None) -> float:
    """Seconds of ``container.restore(snapshot_id)``, ``drop_dir``'s pages dropped first."""
    if drop_dir is not None:
        drop_tree_cache(drop_dir)
    t0 = time.perf_counter()
    container.restore(snapshot_id)
    return time.perf_counter() - t0


def memory(remote: Variant, server_pid: int, state_bytes: int) -> dict[str, Any]:
    """Server RSS split into shared memory (the segments it maps) and the rest; shm used vs
    state bytes; the trainer's RSS split the same way."""
    container = remote.optimizer
    info = container.session.segment
    stats = container.client.stats()
    try:
        st = os.stat(info.path)
        allocated = st.st_blocks * 512
    except OSError:
        allocated = None
    server = proc_status(server_pid)
    trainer = proc_status()
    return {
        "state_bytes": state_bytes,
        "segment_bytes": int(info.size),
        "segment_allocated_bytes": allocated,
        "cow_slots": int(info.cow_slots),
        "chunk_bytes": int(info.chunk_bytes),
        "cow_slot_bytes": int(info.cow_slots) * int(info.chunk_bytes),
        "header_bytes": int(info.header_bytes),
        "server_budget_used_bytes": int(stats.budget_used_bytes),
        "server_budget_total_bytes": int(stats.budget_total_bytes),
        "server": server,
        "server_rss_outside_shm_bytes": server.get("RssAnon", 0) + server.get("RssFile", 0),
        "trainer": trainer,
    }


def commit_latency(server: str, samples: int) -> dict[str, Any]:
    """Step commits on an otherwise idle session (a one-layer model): the container's commit
    is header words in the segment, no RPC, so this is the cost a step pays to commit."""
    from swap_state.client.device import DeviceBackend
    from swap_state.client.remote.container import RemoteSwapOptimizersContainer

    model = torch.nn.Linear(8, 8)
    model(torch.randn(2, 8)).sum().backward()
    container = RemoteSwapOptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-3}, 1,
        server=server, job_id=f"bench-commit-{os.getpid()}", device_backend=DeviceBackend("cpu"),
    )  # fmt: skip
    try:
        container.step()
        session = container.session
        base = int(session.last_committed_step or 0) + 1
        for i in range(min(50, samples)):  # warm the channel
            session.commit(base + i)
        base += 50
        latencies = []
        for i in range(samples):
            t0 = time.perf_counter()
            session.commit(base + i)
            latencies.append(time.perf_counter() - t0)
    finally:
        container.close()
    return {"samples": samples, "commit_s": summarize(latencies)}
