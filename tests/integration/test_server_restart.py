"""The server is not a single point of failure: real server processes killed (SIGKILL) or
stopped (SIGTERM, an upgrade) under a training job, a new one on the same socket and shm
directory adopting the segments, the trainer stepping on and ending bitwise equal to torch's
AdamW; what the shm directory holds is never trusted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from swap_state.client.errors import ServerUnavailableError, SnapshotNotFoundError
from swap_state.client.remote.embedded import EmbeddedServerConfig
from swap_state.common.retry import wait_until

from snapshot_kit import swap_state_cli

from .test_remote_container import _demo
from .workload import Workload, build, reference_mismatches, remote, train


def _adopted_sessions(container) -> list[tuple[str, str, bool]]:
    stats = container.client.stats()
    return [(s.job_id, s.state, s.adopted) for s in stats.sessions]


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_a_server_killed_or_stopped_under_training_costs_the_job_nothing(start_server, how):
    server = start_server(free_segments_on_stop=False)
    w, job = Workload(), f"restart-{how}"
    model = build(w)
    container = remote(w, model, server.address, job, snapshot_model=True, rpc_timeout_s=5.0, server_wait_s=1.0)
    train(model, container, w, range(1, 4))
    container.snapshot().wait_durable(timeout_s=30)

    server.kill() if how == "sigkill" else server.terminate()
    assert wait_until(container.session.server_gone, timeout_s=10)
    train(model, container, w, range(4, 7))  # steps need no server
    began = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="tried again for 1 s") as err:
        container.snapshot()  # asked for during the outage: waits server_wait_s, then names the server
    assert 1.0 <= time.monotonic() - began < 5.0 and server.address in str(err.value)
    train(model, container, w, range(7, 8))  # and training goes on

    server.restart()  # the same socket and shm directory: it adopts the segment
    assert wait_until(lambda: not container.session.server_gone(), timeout_s=10)
    train(model, container, w, range(8, 11))
    assert reference_mismatches(model, container, w, 10) == []
    assert _adopted_sessions(container) == [(job, "live", True)]
    assert container.client.stats().reconnects_total == 1
    status = swap_state_cli("status", "--server", server.address)
    assert "1 adopted from the previous server, 1 trainer reconnects" in status.stdout, status.stdout
    assert f"{job}/rank 0/1 gen 1 live (adopted)" in status.stdout
    container.snapshot().wait_durable(timeout_s=30)
    container.close()

    # That snapshot holds AdamW's bytes of step 10: a fresh trainer restores them.
    fresh_model = build(w)
    fresh = remote(w, fresh_model, server.address, job, snapshot_model=True)
    assert fresh.restore("latest") == 10
    assert reference_mismatches(fresh_model, fresh, w, 10) == []
    fresh.close()


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_a_snapshot_persisting_when_the_server_died_is_not_listed_and_the_next_works(start_server, how):
    # 2 KB/s: the snapshot of step 3 is still persisting when the server is killed.
    server = start_server(persist_max_bandwidth="2K", free_segments_on_stop=False)
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "mid-snapshot", rpc_timeout_s=5.0)
    train(model, container, w, range(1, 4))
    handle = container.snapshot()
    assert handle.status().state == "persisting"
    server.kill() if how == "sigkill" else server.terminate()
    train(model, container, w, range(4, 6))
    server.restart()
    assert wait_until(lambda: not container.session.server_gone(), timeout_s=10)
    assert [s.snapshot_id for s in container.client.list_snapshots("mid-snapshot").snapshots] == []
    with pytest.raises(SnapshotNotFoundError, match="persisting when its server stopped or died is lost"):
        handle.status()  # said as it is: lost with its server, not retired
    if how == "sigterm":  # a server that stops says what it dropped
        assert "event=snapshot_failed snapshot_id=mid-snapshot/step-3" in server.log_text(), server.log_text()[-2000:]
    train(model, container, w, range(6, 8))
    assert container.snapshot().wait_durable(timeout_s=60).state in ("durable", "stored")
    assert reference_mismatches(model, container, w, 7) == []
    container.close()


def test_server_and_trainer_both_killed_the_trainer_reattaches_bitwise(start_server, tmp_path):
    # The adopted segment waits through --grace while the demo starts again (imports, its plain
    # AdamW reference run): on a loaded 2-core machine that outlasted 30 s.
    server = start_server(grace=300.0, free_segments_on_stop=False)
    crashed = _demo(server, tmp_path, "--job-id", "both", "--crash-after-step", "5")
    assert crashed.returncode == -9, crashed.stderr
    server.kill()
    server.restart()  # adopts the dead trainer's segment, which waits through --grace
    # A second restart (SIGTERM) before the trainer is back keeps that orphaned segment too
    # (it used to keep only live sessions' and free this one: the chaos run's faults in a row).
    server.restart()
    assert "reason=shutdown" not in server.log_text()
    resumed = _demo(server, tmp_path, "--job-id", "both", "--resume", "reattach")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "reattached: the server kept the moments of step 5" in resumed.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["digest"] == report["reference_digest"]


def test_a_demo_snapshotting_every_step_trains_through_server_restarts_in_a_row(start_server, tmp_path):
    """Issue 48 item 1: kills and stops in a row, each while the demo snapshots every step
    (whatever call it cuts: Snapshot, its status, Stats); the demo ends rc 0, bitwise AdamW's.
    Before, it died of the second SIGKILL (UNAVAILABLE) or a SIGTERM (CANCELLED)."""
    server = start_server(free_segments_on_stop=False, grace=300.0)
    cmd = [sys.executable, "-m", "swap_state.client.demo", "--server", server.address, "--job-id", "rolling",
           "--steps", "30", "--snapshot-every", "1", "--step-seconds", "0.02", "--report", str(tmp_path / "r.json")]
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each step's line as it is printed
    faults = {4: "kill", 8: "term", 12: "kill", 16: "kill", 20: "term", 24: "kill"}
    try:
        for line in demo.stdout:  # each fault when the demo reached its step: a call is in flight or next
            step = int(line.split()[1]) if line.startswith("step ") else None
            if faults.get(step) == "kill":
                server.kill()
                server.restart()
            elif faults.get(step) == "term":
                server.restart()  # SIGTERM, then a successor on the same socket and shm directory
        rc = demo.wait(timeout=120)
    finally:
        demo.kill()
    stderr = demo.stderr.read()
    assert rc == 0, stderr[-3000:] + server.log_text()[-6000:]
    assert server.restarts == len(faults)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["digest"] == report["reference_digest"]


def _plant(shm_dir: str, prefix: str, real: str) -> dict[str, str]:
    """Files with this server's prefix that must not be adopted, by what they are."""
    name = lambda n: os.path.join(shm_dir, f"{prefix}{n:032x}.{n}")  # noqa: E731
    planted = {"garbage": name(1), "truncated": name(2), "hostile": name(3), "symlink": name(4),
               "fifo": name(5), "bad name": os.path.join(shm_dir, f"{prefix}not-a-session")}
    with open(planted["garbage"], "wb") as f:
        f.write(os.urandom(3 * 4096))
    shutil.copyfile(real, planted["truncated"])
    os.truncate(planted["truncated"], os.path.getsize(real) // 2)
    shutil.copyfile(real, planted["hostile"])
    with open(planted["hostile"], "r+b") as f:  # the descriptor claims another job: "../x"
        data = f.read()
        at = data.rindex(b'"job_id":"') + len(b'"job_id":"')
        f.seek(at)
        f.write(b"../x")
    os.symlink("/etc/passwd", planted["symlink"])
    os.mkfifo(planted["fifo"])
    with open(planted["bad name"], "wb") as f:
        f.write(b"x")
    return planted


def test_planted_files_are_not_adopted_and_nothing_crashes(start_server, private_shm_dir):
    server = start_server()
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "planted", rpc_timeout_s=5.0)
    train(model, container, w, range(1, 3))
    real = container.session.segment.path
    prefix = os.path.basename(real).rsplit(".", 2)[0] + "."
    planted = _plant(private_shm_dir, prefix, real)
    server.kill()
    server.restart()
    assert wait_until(lambda: not container.session.server_gone(), timeout_s=10)
    train(model, container, w, range(3, 11))
    assert reference_mismatches(model, container, w, 10) == []
    assert _adopted_sessions(container) == [("planted", "live", True)]
    log = server.log_text()
    for what, path in planted.items():
        assert os.path.lexists(path), what  # left where it is
        assert f"segment_not_adopted path={path}" in log, (what, log[-3000:])
    container.close()


def _with_embedded_server(job: str, tmp_path):
    """(workload, model, container) on the embedded default (its snapshots under tmp_path),
    trained for 3 steps."""
    w = Workload()
    model = build(w)
    container = remote(w, model, None, job, rpc_timeout_s=5.0,
                       embedded=EmbeddedServerConfig(snapshot_dir=str(tmp_path)))
    train(model, container, w, range(1, 4))
    return w, model, container


def test_the_embedded_default_restarts_its_server_when_it_dies(no_server_env, tmp_path):
    w, model, container = _with_embedded_server("embedded-restart", tmp_path)
    embedded = container.segment.embedded
    embedded.kill()  # the watchdog notices and starts it again on the same socket
    train(model, container, w, range(4, 6))
    back = wait_until(lambda: embedded.restarts == 1 and not container.session.server_gone(), timeout_s=30)
    assert back, (embedded.restarts, container.session._lost, embedded.log_text())
    train(model, container, w, range(6, 11))
    assert reference_mismatches(model, container, w, 10) == []
    assert container.snapshot().wait_durable(timeout_s=30).state in ("durable", "stored")
    container.close()


def test_a_llama3_8b_mlp_weight_survives_a_server_kill_bitwise(start_server):
    from snapshot_kit import bitwise_diff, data_file
    from safetensors.torch import load_file

    from .test_real_shapes import W, build_mlp, fused_adamw, whole_state

    server = start_server(shm_size_bytes=2 << 30)
    ref_model, model = build_mlp(), build_mlp()
    ref = fused_adamw(ref_model)
    assert model.w1.weight.numel() > 2**24
    container = remote(W, model, server.address, "llama3-restart", checkpoint="snapshot", rpc_timeout_s=5.0)
    train(model, container, W, range(1, 3))
    server.kill()
    train(model, container, W, range(3, 4))  # no server: the step goes on
    server.restart()  # adopts a segment of the real shape (moments and model, ~0.7 GB)
    assert wait_until(lambda: not container.session.server_gone(), timeout_s=30)
    train(model, container, W, range(4, 5))
    train(ref_model, ref, W, range(1, 5))
    at_4 = whole_state(model, container)
    status = container.snapshot().wait_durable(timeout_s=240)
    assert bitwise_diff(at_4, load_file(str(data_file(status.path)))) == []
    from .workload import mismatches

    assert mismatches(model, container, ref_model, ref) == []
    container.close()


def _embedded_servers_of(pid: int) -> list[int]:
    """Pids of the embedded servers trainer ``pid`` started (their environment names it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"SWAP_STATE_EXIT_WITH_PARENT={pid}".encode() in environ:
            found.append(int(entry))
    return found


def test_a_killed_trainer_leaks_no_embedded_server(no_server_env, tmp_path):
    import subprocess
    import sys

    demo = subprocess.Popen(
        [sys.executable, "-m", "swap_state.client.demo", "--state-dir", str(tmp_path / "state"),
         "--steps", "400", "--snapshot-every", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert demo.stdout.readline().startswith("swap-state-server:")
        assert wait_until(lambda: _embedded_servers_of(demo.pid), timeout_s=30)
        servers = _embedded_servers_of(demo.pid)
    finally:
        demo.kill()
        demo.wait(30)
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                                      for pid in servers), timeout_s=30), "the embedded server outlived its trainer"


def test_a_forked_child_exiting_leaves_the_parents_session_and_server(no_server_env, tmp_path):
    import atexit

    w, model, container = _with_embedded_server("forked", tmp_path)
    child = os.fork()
    if child == 0:  # what a forked worker's exit runs: the parent's at-exit hooks too
        try:
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert container.segment.embedded._proc.poll() is None  # the server is still running
    train(model, container, w, range(4, 11))
    assert not container.session.server_gone() and reference_mismatches(model, container, w, 10) == []
    assert container.snapshot().wait_durable(timeout_s=30).state in ("durable", "stored")
    container.close()


def test_server_stats_asked_during_a_restart_waits_for_the_new_server(start_server):
    """What the demo's summary does after a rolling restart: stats asked while the server is
    down fail at once without ``wait_s``, and with it are the new server's answer."""
    import concurrent.futures

    server = start_server(free_segments_on_stop=False)
    w = Workload()
    model = build(w)
    container = remote(w, model, server.address, "stats-restart", rpc_timeout_s=5.0)
    train(model, container, w, range(1, 3))
    server.terminate()
    assert wait_until(container.session.server_gone, timeout_s=10)
    with pytest.raises(ServerUnavailableError):
        container.server_stats()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(container.server_stats, wait_s=60)
        time.sleep(1.0)
        assert not asked.done()
        # From this thread: the server exits with the thread that started it (PDEATHSIG).
        server.restart()
        stats = asked.result(timeout=60)
    assert [s.job_id for s in stats.sessions] == ["stats-restart"]
    container.close()
