"""``python -m bench.chaos --minutes M --seed S``: faults in a row, not one at a time.

Two hosts (a server process each, with its own shm and snapshot directories, the snapshot dir a
small tmpfs where mounting one is allowed) share a ``file://`` store and replicate each snapshot
into each other's memory (``--replica-peers``); three jobs train on them
(:mod:`bench.chaos_trainer`: ``solo-a`` on host a, ``pair`` (two ranks in lockstep) and
``solo-b`` on host b), whole-state snapshots every 3 steps. A schedule drawn from the seed
injects, one after another: trainer SIGKILLs, server SIGKILLs and SIGTERMs (a successor adopts
the segments), a host's server and trainers SIGKILLed at once (a container restart, its shm
kept), a lost host (server killed, shm and snapshot dirs wiped, its jobs moved to the other host,
resuming from the replicas in its memory or the store, whichever is newer), a full snapshot
disk, a store outage and hostile clients. The invariants, checked as it runs (a violation is
printed at once and fails the run):

- no trainer dies (only the harness kills them) or stalls (a step within ``--stall-s``);
- a trainer resumes at a step no older than the newest durable one known before its fault
  (after a lost host: the newest complete stored one, or replicated into the other host);
- every durable snapshot and replica found on a host holds plain AdamW's bytes of its step
  (model and moments, bitwise);
- a job's newest durable step on a host never goes back (a lost host starts afresh);
- recovery: every trainer a fault touched steps again, and a snapshot it asks for after the fault
  is durable, within ``--stall-s``;
- each server's anonymous memory and open files stay bounded;
- at the end, after every trainer detached, no segment is left in any shm directory.

It prints every fault and recovery time, and a summary (faults by kind, recoveries, worst
recovery, snapshots verified, violations); the same seed draws the same schedule. Exit 1 on
any violation. docs/reliability.md lists the invariants, faults, the bugs it found and their
regression tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from swap_state.client.errors import SwapStateError
from swap_state.client.export.snapshot import locate, read_snapshot_state
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.common.object_store import PosixObjectStore
from swap_state.common.stored_snapshots import StoredSnapshots
from swap_state.proto import swap_state_pb2 as pb

from bench import chaos_trainer
from bench.util import free_port

__all__ = ["main"]

FAULTS = {"trainer_kill": 3, "server_kill": 2, "server_term": 2, "host_restart": 1, "host_loss": 1, "disk_full": 1,
          "store_outage": 1, "hostile_client": 2}
"""Each fault kind and its weight in the draw."""
MAX_ANON_RSS = 400 << 20  # a server's anonymous memory (its segments are shared memory)
MAX_FDS = 256


@dataclasses.dataclass
class Host:
    name: str
    shm: pathlib.Path
    snapshots: pathlib.Path
    server: EmbeddedServer | None = None
    mounted: bool = False


@dataclasses.dataclass
class Job:
    name: str
    ranks: int
    host: str
    progress: pathlib.Path
    log: pathlib.Path
    process: subprocess.Popen | None = None
    lines_read: int = 0
    step: int = 0
    last_progress: float = 0.0
    expected_exit: bool = False
    starts: list[int] = dataclasses.field(default_factory=list)
    floor: int = 0  # the step its next start must not be older than
    since: float | None = None  # a fault's wall time, while waiting for the trainer's first step or start after it
    back: dict[str, float] = dataclasses.field(default_factory=dict)  # its trainer's events after the fault, wall time
    restarted: bool = False  # the fault restarts the trainer: only the new one's events count
    first_snapshot: int | None = None  # the step of the first snapshot asked for after the fault


class Chaos:
    """The run: hosts, jobs, the schedule and the checks (one thread)."""

    def __init__(self, args: argparse.Namespace, work: pathlib.Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.store = work / "store"
        self.stop_file = work / "stop"
        self.hosts = {name: Host(name, pathlib.Path(tempfile.mkdtemp(prefix=f"chaos-{name}-", dir="/dev/shm")),
                                 work / f"{name}-snapshots") for name in ("a", "b")}
        self.replica_ports = {name: free_port() for name in self.hosts}  # kept by a replacement host
        self.secret = work / "replica-secret"
        self.jobs = {name: Job(name, ranks, host, work / f"{name}.progress", work / f"{name}.log")
                     for name, ranks, host in (("solo-a", 1, "a"), ("pair", 2, "b"), ("solo-b", 1, "b"))}
        self.violations: list[str] = []
        self.faults: dict[str, int] = {}
        self.recoveries: list[float] = []
        self.verified: set[tuple] = set()  # (host, job, step, and the index file's identity)
        self.newest: dict[tuple[str, str], int] = {}
        self.references = {name: chaos_trainer.Reference(name) for name in self.jobs}
        self.started = time.monotonic()

    # -- hosts ------------------------------------------------------------------------------
    def start_host(self, host: Host) -> None:
        host.snapshots.mkdir(parents=True, exist_ok=True)
        if not host.mounted and os.geteuid() == 0:  # a small disk of its own, to fill
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0700", "tmpfs", str(host.snapshots)],
                                  capture_output=True, text=True)
            host.mounted = done.returncode == 0
        other = next(name for name in self.hosts if name != host.name)
        config = EmbeddedServerConfig(shm_size_bytes=512 << 20, snapshot_dir=str(host.snapshots), auto_restart=False,
                                      server={"shm_dir": str(host.shm), "grace": 300.0, "keep_latest": 3,
                                              "snapshot_store": f"file://{self.store}", "snapshot_store_timeout": 5.0,
                                              "free_segments_on_stop": False,
                                              "replica_listen": f"tcp://127.0.0.1:{self.replica_ports[host.name]}",
                                              "replica_peers": f"tcp://127.0.0.1:{self.replica_ports[other]}",
                                              "replica_size": "256M", "replica_secret_file": str(self.secret)})
        host.server = EmbeddedServer(config).start()

    def say(self, text: str) -> None:
        print(f"[chaos {time.monotonic() - self.started:7.1f}s] {text}", flush=True)

    def violation(self, text: str) -> None:
        self.violations.append(text)
        self.say(f"VIOLATION: {text}")

    # -- trainers ---------------------------------------------------------------------------
    def start_job(self, job: Job, floor: int) -> None:
        job.floor, job.expected_exit = floor, False
        address = self.hosts[job.host].server.address
        cmd = [sys.executable, "-m", "bench.chaos_trainer", "--server", address, "--job", job.name,
               "--ranks", str(job.ranks), "--steps", "1000000", "--step-seconds", "0.1", "--progress", str(job.progress),
               "--stop-file", str(self.stop_file)]
        with open(job.log, "ab") as log:
            job.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        job.last_progress = time.monotonic()

    def kill_job(self, job: Job) -> None:
        if job.process is not None and job.process.poll() is None:
            job.expected_exit = True
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait(30)

    def read_progress(self, job: Job) -> None:
        if not job.progress.exists():
            return
        lines = job.progress.read_text().splitlines()
        for line in lines[job.lines_read:]:
            event = json.loads(line)
            if job.since is not None and event["t"] >= job.since:
                self.note_after_fault(job, event)
            if event["event"] == "start":
                job.starts.append(event["step"])
                if event["step"] < job.floor:
                    self.violation(f"{job.name} resumed at step {event['step']}, older than step {job.floor} "
                                   "known durable before its fault")
                job.step, job.last_progress = event["step"], time.monotonic()
            elif event["event"] == "step":
                job.step, job.last_progress = event["step"], time.monotonic()
        job.lines_read = len(lines)

    # -- checks -----------------------------------------------------------------------------
    def check(self) -> None:
        for job in self.jobs.values():
            self.read_progress(job)
            code = job.process.poll() if job.process is not None else None
            if code is not None and not job.expected_exit and not self.stop_file.exists():
                tail = job.log.read_text(errors="replace")[-1500:]
                self.violation(f"{job.name}'s trainer exited with {code}:\n{tail}")
                self.start_job(job, self.newest_durable(job))
            elif code is None and time.monotonic() - job.last_progress > self.args.stall_s:
                self.violation(f"{job.name} made no step for {self.args.stall_s:g} s (at step {job.step})")
                job.last_progress = time.monotonic()
        for host in self.hosts.values():
            self.verify_snapshots(host)
            self.check_server(host)

    def newest_durable(self, job: Job) -> int:
        return self.newest.get((self.hosts[job.host].name, job.name), 0)

    def snapshot_roots(self, host: Host) -> list[tuple[str, pathlib.Path]]:
        """(name, directory) of the host's snapshots and of the replicas it holds."""
        return [(host.name, host.snapshots),
                *((f"{host.name}-replicas", p) for p in sorted(host.shm.glob("swap-state-replicas-*")))]

    def verify_snapshots(self, host: Host) -> None:
        """The host's complete snapshots and replicas: the newest never goes back; each new one
        (or one replaced by a later attempt at its step) is checked against plain AdamW, by step."""
        found = []
        for (name, root), job in ((root, job) for root in self.snapshot_roots(host) for job in self.jobs):
            indexes = sorted((int(p.parent.name.removeprefix("step-")), p)
                             for p in (root / job).glob("step-*/snapshot.json"))
            if not indexes:
                continue
            newest, key = indexes[-1][0], (name, job)
            if newest < self.newest.get(key, 0):
                self.violation(f"{job}'s newest durable step on host {host.name} went back: "
                               f"{self.newest[key]} -> {newest}")
            self.newest[key] = max(newest, self.newest.get(key, 0))
            for step, index in indexes:
                with contextlib.suppress(OSError):  # retired meanwhile
                    stat = index.stat()
                    mark = (host.name, job, step, stat.st_ino, stat.st_mtime_ns)
                    if mark not in self.verified:
                        found.append((job, step, mark, root))
        for job, step, mark, root in sorted(found):
            self.verify(host, job, step, mark, root)

    def verify(self, host: Host, job: str, step: int, mark: tuple, root: pathlib.Path) -> None:
        try:
            state = read_snapshot_state(locate(f"{job}/step-{step}", root))
        except (SwapStateError, OSError) as e:
            if (root / job / f"step-{step:012d}").exists():  # not retired (nor evicted) meanwhile
                self.violation(f"{job}/step-{step} in {root} on host {host.name} cannot be read: {e}")
            return
        reference = self.references[job] = self.references[job].at(step)
        wrong = [k for k, v in reference.model.state_dict().items()
                 if not torch.equal(state.model.get(k, torch.empty(0)), v)]
        for name, param in reference.model.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(state.optimizer.get(f"state.{name}.{key}", torch.empty(0)),
                                   reference.optimizer.state[param][key]):
                    wrong.append(f"state.{name}.{key}")
        if wrong:
            self.violation(f"{job}/step-{step} on host {host.name} is not plain AdamW's: {wrong[:4]}")
        self.verified.add(mark)

    def check_server(self, host: Host) -> None:
        pid = host.server.pid if host.server is not None else None
        if pid is None:
            return
        with contextlib.suppress(OSError):
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
            anon = int(status.get("RssAnon", "0 kB").split()[0]) << 10
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            if anon > MAX_ANON_RSS or fds > MAX_FDS:
                self.violation(f"host {host.name}'s server holds {anon >> 20} MiB anonymous memory and {fds} fds")

    @staticmethod
    def note_after_fault(job: Job, event: dict[str, Any]) -> None:
        """Record a trainer's event after the fault: the first of each kind, the first step of a restarted
        trainer, and when a snapshot asked for after the fault became durable."""
        kind, t = event["event"], event["t"]
        job.back.setdefault(kind, t)
        current = "start" in job.back or not job.restarted  # the trainer that runs after the fault
        if kind == "step" and "start" in job.back:
            job.back.setdefault("first step", t)
        if kind == "snapshot" and current and job.first_snapshot is None:
            job.first_snapshot = event["step"]
        if kind == "durable" and job.first_snapshot is not None and event["step"] >= job.first_snapshot:
            job.back.setdefault("durable again", t)

    def wait_recovered(self, jobs: list[Job], fault: str, since: float, restarted: bool = False) -> None:
        """Until each of ``jobs`` made a step after ``since`` (the fault's wall time; ``restarted``: a step of the
        trainer started after it) and a snapshot it asked for after it is durable, bounded by --stall-s. Timed
        by the trainers' own events, not by this loop, whose checks (the bitwise verification of new snapshots)
        take seconds of their own."""
        if not jobs:
            return  # a host with no trainer left on it
        began, mark = time.monotonic(), "first step" if restarted else "step"
        for job in jobs:
            job.since, job.back, job.restarted, job.first_snapshot = since, {}, restarted, None
        while time.monotonic() - began < self.args.stall_s:
            self.check()
            if all(mark in job.back and "durable again" in job.back for job in jobs):
                took = max(job.back[mark] for job in jobs) - since
                self.recoveries.append(took)
                parts = {name: round(max(job.back[name] for job in jobs if name in job.back) - since, 1)
                         for name in ("launched", "attached", "start", "durable again")
                         if any(name in job.back for job in jobs)}
                self.say(f"  recovered from {fault} in {took:.1f} s (trainer events, s after the fault: {parts})")
                for job in jobs:
                    job.since = None
                return
            time.sleep(0.2)
        self.violation(f"{', '.join(j.name for j in jobs)} not stepping, or no snapshot durable, {self.args.stall_s:g} s "
                       f"after {fault}")

    # -- faults -----------------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        host = self.hosts[self.rng.choice(sorted(self.hosts))]
        on_host = [j for j in self.jobs.values() if j.host == host.name]
        if kind == "trainer_kill":
            job = self.jobs[self.rng.choice(sorted(self.jobs))]
            self.say(f"fault: SIGKILL trainer {job.name} (at step {job.step})")
            self.check()
            since = time.time()
            self.kill_job(job)
            self.start_job(job, self.newest_durable(job))
            self.wait_recovered([job], kind, since, restarted=True)
        elif kind in ("server_kill", "server_term"):
            self.say(f"fault: {'SIGKILL' if kind == 'server_kill' else 'SIGTERM'} host {host.name}'s server, a successor adopts")
            since = time.time()
            if kind == "server_kill":
                host.server.kill()
            host.server.restart()
            self.wait_recovered(on_host, kind, since)
        elif kind == "host_restart":  # a container restarted: every process at once, its shm kept
            self.say(f"fault: SIGKILL host {host.name}'s server and trainers {[j.name for j in on_host]} at once, "
                     "the shm kept; a successor adopts, the trainers restart")
            self.check()
            since = time.time()
            host.server.kill()
            for job in on_host:
                self.kill_job(job)
            host.server.restart()
            for job in on_host:
                self.start_job(job, self.newest_durable(job))
            self.wait_recovered(on_host, kind, since, restarted=True)
        elif kind == "host_loss":
            self.host_loss(host, on_host)
        elif kind == "disk_full":
            self.disk_full(host, on_host)
        elif kind == "store_outage":
            self.say("fault: the store unreachable for 4 s (its root replaced by a file)")
            away = self.work / "store-away"
            self.store.rename(away)
            self.store.write_text("unreachable")
            self.pause(4.0)
            self.store.unlink()
            away.rename(self.store)
        elif kind == "hostile_client":
            self.say(f"fault: a hostile client at host {host.name}")
            self.hostile(host)

    def host_loss(self, host: Host, on_host: list[Job]) -> None:
        other = next(h for h in self.hosts.values() if h is not host)
        self.check()
        since = time.time()
        stored = StoredSnapshots(PosixObjectStore(self.store))
        floors = {}
        for job in on_host:
            with contextlib.suppress(SwapStateError, OSError):
                floors[job.name] = max((i.step for i in stored.list(job.name)), default=0)
            replicated = [int(p.parent.name.removeprefix("step-"))
                          for p in other.shm.glob(f"swap-state-replicas-*/{job.name}/step-*/snapshot.json")]
            floors[job.name] = max([floors.get(job.name, 0), *replicated])
        self.say(f"fault: host {host.name} lost; {[j.name for j in on_host]} move to host {other.name} "
                 f"(newest stored or replicated steps {floors})")
        host.server.kill()
        for job in on_host:
            self.kill_job(job)
        host.server.stop()
        for path in (host.shm, host.snapshots):
            for entry in list(path.iterdir()) if path.exists() else []:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        for (name, job), _ in list(self.newest.items()):
            if name in (host.name, f"{host.name}-replicas"):
                del self.newest[name, job]
        self.verified = {v for v in self.verified if v[0] != host.name}
        self.start_host(host)  # a replacement host, empty
        for job in on_host:
            job.host = other.name
            self.start_job(job, floors.get(job.name, 0))
        if on_host:
            self.wait_recovered(on_host, "host_loss", since, restarted=True)

    def disk_full(self, host: Host, on_host: list[Job]) -> None:
        if not host.mounted:
            self.say(f"fault: disk_full skipped (no tmpfs of its own could be mounted for host {host.name})")
            return
        free = shutil.disk_usage(host.snapshots).free
        filler = host.snapshots / "filler"
        self.say(f"fault: host {host.name}'s snapshot disk full for 5 s")
        with open(filler, "wb") as f:
            with contextlib.suppress(OSError):
                f.truncate(0)
                os.posix_fallocate(f.fileno(), 0, max(0, free - (4 << 10)))
        self.pause(5.0)
        filler.unlink()

    def hostile(self, host: Host) -> None:
        client = SwapStateClient(ClientConfig(host.server.address, rpc_timeout_s=5.0))
        calls = [
            ("Attach", pb.AttachRequest(job_id="../../etc/passwd", rank=0, world_size=1)),
            ("Attach", pb.AttachRequest(job_id="x" * 5000, rank=0, world_size=1)),
            ("Attach", pb.AttachRequest(job_id="pair", rank=7, world_size=2)),
            ("Snapshot", pb.SnapshotRequest(session_id="0" * 32, generation=1, step=3)),
            ("Allocate", pb.AllocateRequest(session_id="f" * 32, generation=1,
                                            tensors=[pb.TensorSpec(name="state.w.exp_avg", dtype="float32",
                                                                   shape=[1 << 40])])),
            ("SnapshotStatus", pb.SnapshotStatusRequest(snapshot_id="solo-a/step-999999", rank=0)),
            ("Restore", pb.RestoreRequest(session_id="1" * 32, generation=2, snapshot_id="../x")),
            ("Detach", pb.DetachRequest(session_id="z" * 32, generation=1)),
        ]
        try:
            for name, request in calls:
                with contextlib.suppress(SwapStateError):
                    client.call(name, request)
            client.stats(server_wait_s=0.0)  # still serving
        except SwapStateError as e:
            self.violation(f"host {host.name}'s server stopped answering after hostile calls: {e}")
        finally:
            client.close()

    def pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.check()
            time.sleep(0.2)

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> int:
        self.store.mkdir()
        self.secret.write_text("chaos-replica-secret-0123456789abcdef")
        self.secret.chmod(0o600)
        for host in self.hosts.values():
            self.start_host(host)
        for job in self.jobs.values():
            self.start_job(job, 0)
        self.pause(self.args.warmup_s)
        kinds, weights = zip(*sorted(FAULTS.items()))
        deadline = self.started + self.args.minutes * 60
        while time.monotonic() < deadline:
            self.inject(self.rng.choices(kinds, weights)[0])
            self.pause(self.rng.uniform(self.args.gap_s / 2, self.args.gap_s * 1.5))
        self.finish()
        return self.summary()

    def finish(self) -> None:
        self.stop_file.write_text("stop")
        end = time.monotonic() + 180
        for job in self.jobs.values():
            if job.process is not None:
                try:
                    code = job.process.wait(max(1.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.violation(f"{job.name}'s trainer did not finish within 180 s of the stop")
                    self.kill_job(job)
                    continue
                if code != 0 and not job.expected_exit:
                    self.violation(f"{job.name}'s trainer ended with {code}: {job.log.read_text(errors='replace')[-800:]}")
        self.check()
        for host in self.hosts.values():
            left = sorted(p.name for p in host.shm.iterdir()
                          if not p.name.startswith(("swap-state-replicas-", "swap-state-memory-")))
            if left:
                self.violation(f"host {host.name}'s shm directory still holds {left} after every trainer detached")

    def close(self) -> None:
        for job in self.jobs.values():
            self.kill_job(job)
        for host in self.hosts.values():
            if host.server is not None:
                host.server.stop()
            if host.mounted:
                subprocess.run(["umount", "-l", str(host.snapshots)], capture_output=True)
            shutil.rmtree(host.shm, ignore_errors=True)

    def summary(self) -> int:
        worst = max(self.recoveries, default=0.0)
        mean = sum(self.recoveries) / len(self.recoveries) if self.recoveries else 0.0
        steps = {job.name: job.step for job in self.jobs.values()}
        self.say(f"summary: seed {self.args.seed}, {self.args.minutes:g} min; faults {dict(sorted(self.faults.items()))} "
                 f"({sum(self.faults.values())}); recoveries {len(self.recoveries)}, mean {mean:.1f} s, worst {worst:.1f} s; "
                 f"snapshots verified bitwise {len(self.verified)}; steps reached {steps}; violations {len(self.violations)}")
        return 1 if self.violations else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long faults are injected (then every trainer finishes)")
    parser.add_argument("--seed", type=int, default=1, help="the seed of the fault schedule")
    parser.add_argument("--gap-s", type=float, default=8.0, help="mean seconds between faults")
    parser.add_argument("--stall-s", type=float, default=90.0, help="the bound on a trainer's silence and on recovery")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="seconds of training before the first fault")
    parser.add_argument("--work-dir", default=None, help="where the run's files go (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="swap-state-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args, work)
    try:
        return chaos.run()
    finally:
        chaos.close()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
