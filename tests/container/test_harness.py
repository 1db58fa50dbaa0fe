"""The harness's own guarantees, with trivial programs: what the scenario's pass relies on."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from . import harness
from .conftest import MakePod
from .harness import REPO_ROOT, SNAPSHOT_DIR, SOCKET_DIR, Pod, Volume, wait_for

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def py(code: str) -> list[str]:
    """A container command running ``code`` with the harness's python (on PATH, as in the image)."""
    return ["python", "-c", textwrap.dedent(code)]


def run(pod: Pod, name: str, code: str, volumes: tuple[Volume, ...] = (), timeout: float = 30) -> str:
    """Run ``code`` in a new container, require exit 0, return its output."""
    box = pod.container(name, volumes).start(py(code))
    rc = box.wait(timeout)
    assert rc == 0, f"{name} exited {rc}:\n{box.logs}"
    return box.logs


def json_line(output: str) -> dict[str, object]:
    return json.loads(output.strip().splitlines()[-1])


def test_containers_share_dev_shm_pages(pod: Pod) -> None:
    """Two containers map one /dev/shm file and see each other's stores, like server and trainer."""
    seg = f"seg-{uuid.uuid4().hex}"
    writer = pod.container("writer").start(py(f"""
        import mmap, os, time
        fd = os.open("/dev/shm/{seg}", os.O_RDWR | os.O_CREAT, 0o666)
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20)
        m[:4096] = bytes(range(256)) * 16
        print("written", flush=True)
        deadline = time.monotonic() + 20
        while m[4096] != 0xAB:  # the reader's answer, through the same pages
            assert time.monotonic() < deadline, "no answer from the reader"
            time.sleep(0.005)
        print("answer seen", flush=True)
    """))
    wait_for(lambda: "written" in writer.logs, 20, what="the writer")
    run(pod, "reader", f"""
        import mmap, os
        fd = os.open("/dev/shm/{seg}", os.O_RDWR)
        m = mmap.mmap(fd, 1 << 20)
        assert m[:4096] == bytes(range(256)) * 16
        m[4096] = 0xAB
    """)
    assert writer.wait(20) == 0, writer.logs
    assert "answer seen" in writer.logs
    # Shared inside the pod only: the host's own /dev/shm never sees it.
    assert (pod.shm_host_path / seg).stat().st_size == MIB
    assert not (Path("/dev/shm") / seg).exists()


def test_dev_shm_size_limit_enforced(make_pod: MakePod) -> None:
    pod = make_pod("8m")
    out = json_line(run(pod, "filler", """
        import errno, json, os
        st = os.statvfs("/dev/shm")
        fd = os.open("/dev/shm/big", os.O_RDWR | os.O_CREAT, 0o600)
        try:  # how the server commits a segment up front
            os.posix_fallocate(fd, 0, 16 << 20)
            fallocate = "ok"
        except OSError as e:
            fallocate = errno.errorcode[e.errno]
        written, write_error = 0, None
        try:
            while True:
                written += os.write(fd, b"x" * (1 << 20))
        except OSError as e:
            write_error = errno.errorcode[e.errno]
        print(json.dumps({"total": st.f_blocks * st.f_frsize, "fallocate": fallocate,
                          "written": written, "write_error": write_error}))
    """))
    assert out["total"] == 8 * MIB
    assert out["fallocate"] == "ENOSPC"
    assert out["write_error"] == "ENOSPC"
    assert out["written"] <= 8 * MIB


def test_pid_namespace_isolation(pod: Pod) -> None:
    server = pod.container("server").start(py("""
        import os, time
        assert os.getpid() == 1
        print("server-up", flush=True)
        time.sleep(60)
    """))
    wait_for(lambda: "server-up" in server.logs, 20, what="the server")
    out = json_line(run(pod, "trainer", f"""
        import json, os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        # Spelled backwards here so this very command line does not match.
        cmdlines = [open(f"/proc/{{p}}/cmdline", "rb").read()[::-1] for p in pids]
        try:
            os.kill({server.pid}, 0)  # the server's PID on the host
            signalled = "delivered"
        except ProcessLookupError:
            signalled = "ESRCH"
        print(json.dumps({{"me": os.getpid(), "pids": pids, "signalled": signalled,
                          "sees_server": any(b"pu-revres" in c for c in cmdlines)}}))
    """))
    assert out["me"] == 1
    assert out["pids"] == [1]
    assert out["signalled"] == "ESRCH"
    assert out["sees_server"] is False
    assert server.running


def test_network_isolation_only_the_socket_connects(pod: Pod) -> None:
    sock_dir = pod.volume("socket")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as host_listener:
        host_listener.bind(("127.0.0.1", 0))
        host_listener.listen()
        host_port = host_listener.getsockname()[1]
        server = pod.container("server", [Volume(sock_dir, SOCKET_DIR)]).start(py(f"""
            import socket, time
            tcp = socket.create_server(("127.0.0.1", 7777))
            uds = socket.socket(socket.AF_UNIX)
            uds.bind("{SOCKET_DIR}/s.sock")
            uds.listen()
            conn, _ = uds.accept()
            conn.sendall(b"hello over uds")
            time.sleep(60)
        """))
        wait_for(lambda: (sock_dir / "s.sock").exists() or not server.running, 20, what="the socket")
        out = json_line(run(pod, "trainer", f"""
            import errno, json, socket
            def tcp(port):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                    return "connected"
                except OSError as e:
                    return errno.errorcode.get(e.errno, str(e))
            uds = socket.socket(socket.AF_UNIX)
            uds.connect("{SOCKET_DIR}/s.sock")
            print(json.dumps({{"uds": uds.recv(100).decode(), "server_tcp": tcp(7777),
                              "host_tcp": tcp({host_port}),
                              "interfaces": [n for _, n in socket.if_nameindex()]}}))
        """, volumes=(Volume(sock_dir, SOCKET_DIR),)))
    assert out["uds"] == "hello over uds"
    assert out["server_tcp"] == "ECONNREFUSED"
    assert out["host_tcp"] == "ECONNREFUSED"
    assert out["interfaces"] == ["lo"]


def test_filesystem_view(pod: Pod) -> None:
    """Only the image-like read-only binds, the given volumes and private /tmp; own hostname."""
    snapshots, state = pod.volume("snapshots"), pod.volume("state")
    host_tmp_file = Path(tempfile.gettempdir()) / f"host-only-{uuid.uuid4().hex}"
    host_tmp_file.write_text("not for containers")
    out = json_line(run(pod, "trainer", f"""
        import errno, json, os, socket
        def write(path):
            try:
                with open(path, "w") as f:
                    f.write("x")
                return "ok"
            except OSError as e:
                return errno.errorcode[e.errno]
        print(json.dumps({{
            "hostname": socket.gethostname(), "uid": os.getuid(),
            "host_tmp_visible": os.path.exists("{host_tmp_file}"),
            "pod_root_visible": os.path.exists("{pod.root}"),
            "root": sorted(os.listdir("/")),
            "repo_write": write("{REPO_ROOT}/should-not-exist"),
            "snapshots_write": write("{SNAPSHOT_DIR}/x"), "state_write": write("/state/x"),
            "shm_write": write("/dev/shm/x"),
        }}))
    """, volumes=(Volume(snapshots, SNAPSHOT_DIR, read_only=True), Volume(state, "/state"))))
    assert out["hostname"] == "trainer"
    assert out["uid"] == pod.support.uid
    host_tmp_file.unlink()
    assert out["host_tmp_visible"] is False
    assert out["pod_root_visible"] is False
    assert "snapshots" in out["root"] and "state" in out["root"]
    assert out["repo_write"] == "EROFS"
    assert out["snapshots_write"] == "EROFS"
    assert out["state_write"] == "ok" and (state / "x").read_text() == "x"
    assert out["shm_write"] == "ok"
    assert not (REPO_ROOT / "should-not-exist").exists()


def test_exec_runs_inside_the_container(pod: Pod) -> None:
    box = pod.container("server").start(["sleep", "60"])
    result = box.exec(["sh", "-c", "hostname; tr '\\0' ' ' </proc/1/cmdline; echo; id -u"])
    assert result.returncode == 0, result.stderr
    hostname, pid1, uid = result.stdout.splitlines()
    assert (hostname, pid1.strip(), int(uid)) == ("server", "sleep 60", pod.support.uid)


def test_stop_kill_and_exit_status(pod: Pod) -> None:
    # PID 1 without a SIGTERM handler ignores it, as in Docker: stop() ends with SIGKILL.
    ignores = pod.container("ignores-term").start(["sleep", "60"])
    started = time.monotonic()
    assert ignores.stop(timeout=0.5) == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5
    handles = pod.container("handles-term").start(py("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("ready", flush=True)
        time.sleep(60)
    """))
    wait_for(lambda: "ready" in handles.logs, 20, what="the handler")
    assert handles.stop(timeout=10) == 0
    killed = pod.container("killed").start(["sleep", "60"])
    killed.kill()
    assert killed.wait(10) == -signal.SIGKILL
    assert pod.container("exit-3").start(["sh", "-c", "exit 3"]).wait(10) == 3
    missing = pod.container("missing").start(["no-such-command"])
    assert missing.wait(10) == 127
    assert "no-such-command" in missing.logs


def test_pause_and_resume(pod: Pod) -> None:
    box = pod.container("ticker").start(py("""
        import time
        while True:
            print("tick", flush=True)
            time.sleep(0.01)
    """))
    wait_for(lambda: "tick" in box.logs, 20, what="ticks")
    box.pause()
    time.sleep(0.1)  # let a tick already in flight land
    frozen = box.logs.count("tick")
    time.sleep(0.3)
    assert box.logs.count("tick") == frozen
    box.resume()
    wait_for(lambda: box.logs.count("tick") > frozen, 10, what="ticks after resume")


def test_reset_shm_gives_the_next_server_an_empty_dev_shm(pod: Pod) -> None:
    run(pod, "first", "open('/dev/shm/old-segment', 'w').write('x')")
    pod.reset_shm()
    out = run(pod, "second", "import os; print(os.listdir('/dev/shm'))")
    assert out.strip() == "[]"


def test_teardown_leaves_no_mounts_or_processes(host_support: harness.HostSupport) -> None:
    pod = Pod("4m", support=host_support)
    boxes = [pod.container(n).start(["sleep", "60"]) for n in ("a", "b")]
    root, holder = pod.root, pod.holder_pid
    # The mounts exist, but only inside the pod's namespaces; never in ours.
    holder_mounts = Path(f"/proc/{holder}/mountinfo").read_text()
    assert f" {pod.shm_dir} " in holder_mounts
    assert " /dev/shm " in Path(f"/proc/{boxes[0].pid}/mountinfo").read_text()
    assert harness.host_mounts_under(root) == []
    pod.close()
    assert not root.exists()
    assert harness.host_mounts_under(root) == []
    assert all(b.returncode is not None for b in boxes)
    assert pod._holder is not None and pod._holder.returncode is not None  # reaped
    pod.close()  # idempotent


def test_probe_names_the_missing_kernel_feature(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel forbids a namespace, the skip reason says which, in unshare's words."""
    fake = tmp_path / "unshare"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        for a in "$@"; do
          if [ "$a" = "--net" ]; then echo "unshare: unshare failed: Operation not permitted" >&2; exit 1; fi
        done
        exit 0
    """))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(harness.HarnessUnavailable, match=r"^unshare --net failed: Operation not permitted$"):
        harness._probe_flags(rootless=False)
    with pytest.raises(harness.HarnessUnavailable,
                       match=r"^unshare --user --map-root-user --net failed: Operation not permitted$"):
        harness._probe_flags(rootless=True)
