"""On a unix socket without tokens the caller's uid is its tenant: two unprivileged users this
test creates, each a real trainer process, against one real server run by root. The second
user can neither take, detach, list nor restore the first's job; root (an admin) sees both."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.common.retry import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GROUP, USERS = "swap-state-test", ("swap-state-test-a", "swap-state-test-b")
TOOLS = ("groupadd", "useradd")

# Run as root so that the interpreter and its modules load (this interpreter may live under
# /root), then drop to the user before the first call: every call is that user's.
AS_USER = r"""
import json, os, pwd, sys
from swap_state.client import errors
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient
from swap_state.proto import swap_state_pb2 as pb
address, user, action, arg = sys.argv[1:5]
entry = pwd.getpwnam(user)
os.setgroups([])
os.setgid(entry.pw_gid)
os.setuid(entry.pw_uid)
client = SwapStateClient(ClientConfig(address, rpc_timeout_s=10.0))
out = {"uid": os.getuid()}
try:
    if action == "own":
        session = client.attach("uid-job", 0, 1)
        out["segment"] = session.allocate([("w", "float32", [64, 64])]).segment.path
        session.commit(1)
        snapshot_id = session.snapshot(1).snapshot_id
        out["state"] = client.snapshot_status(snapshot_id, 0, wait_s=30.0).state
        out.update(snapshot_id=snapshot_id, session_id=session.session_id, generation=session.generation)
        session.close(keep=True)  # kept for its trainer (--grace): still this user's
    else:
        session_id, generation = arg.split(":")
        for name, call in [
            ("attach", lambda: client.attach("uid-job", 0, 1)),
            ("detach", lambda: client.call("Detach", pb.DetachRequest(session_id=session_id,
                                                                      generation=int(generation)))),
            ("status", lambda: client.snapshot_status("uid-job/step-1", 0)),
        ]:
            try:
                call()
                out[name] = "allowed"
            except errors.SwapStateError as e:
                out[name] = e.reason
        try:
            open(sys.argv[5], "rb").close()
            out["open_segment"] = "allowed"
        except PermissionError:
            out["open_segment"] = "denied"
        out["listed"] = [s.snapshot_id for s in client.list_snapshots().snapshots]
        out["sessions"] = [s.job_id for s in client.stats().sessions]
finally:
    client.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        pytest.skip("needs root to create two users (CI runs as root)")
    if not all(shutil.which(tool) for tool in TOOLS):
        pytest.skip(f"needs {' and '.join(TOOLS)} to create two users")
    subprocess.run(["groupadd", "-f", GROUP], check=True)
    for user in USERS:
        if subprocess.run(["id", user], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "-M", "-N", "-g", GROUP, "-s", "/usr/sbin/nologin", user], check=True)
    return USERS


class RootServer:
    """A root-run server whose socket both users reach (--socket-group); :meth:`kill_and_start`
    stands for a crash and the daemon's restart."""

    def __init__(self):
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-uid-"))
        self.shm = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-uid-", dir="/dev/shm"))
        for path in (self.root, self.shm):
            path.chmod(0o755)
        self.address = f"unix://{self.root / 's.sock'}"
        self.log = (self.root / "server.log").open("a")
        self.proc: subprocess.Popen | None = None
        self.admin: SwapStateClient | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swap_state.server.cli", "--shm-size", "64M", "--listen", self.address,
             "--shm-dir", str(self.shm), "--socket-group", GROUP, "--snapshot-dir", str(self.root / "snapshots"),
             "--chunk-bytes", "64K", "--grace", "60"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        sock = self.root / "s.sock"  # a loaded machine may take longer than the client's short wait for it
        assert wait_until(lambda: sock.exists() or self.proc.poll() is not None, timeout_s=60) and self.proc.poll() is None
        self.admin = SwapStateClient(ClientConfig(self.address, rpc_timeout_s=10.0, connect_timeout_s=30.0))
        self.admin.wait_ready()  # root: an admin

    def kill_and_start(self) -> None:
        self.admin.close()
        self.proc.kill()
        self.proc.wait(30)
        self.start()

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


@pytest.fixture
def shared_server(users):
    server = RootServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _as(user: str, address: str, action: str, arg: str = "", path: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", AS_USER, address, user, action, arg, path],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_users_job_is_its_own(shared_server, users):
    address, first, second = shared_server.address, *users
    mine = _as(first, address, "own")
    assert mine["state"] == "durable" and mine["uid"] != 0
    # A root daemon gives the user's segment file to that user alone, whatever --shm-group.
    info = os.stat(mine["segment"])
    assert (info.st_uid, info.st_mode & 0o777) == (mine["uid"], 0o600)
    theirs = _as(second, address, "probe", f"{mine['session_id']}:{mine['generation']}", mine["segment"])
    assert theirs["uid"] not in (0, mine["uid"])
    assert (theirs["attach"], theirs["detach"], theirs["status"]) == ("PERMISSION_DENIED",) * 3
    assert theirs["listed"] == [] and theirs["sessions"] == [] and theirs["open_segment"] == "denied"
    # Root is an admin: it sees the first user's session and snapshot.
    assert [s.job_id for s in shared_server.admin.stats().sessions] == ["uid-job"]
    assert [s.snapshot_id for s in shared_server.admin.list_snapshots().snapshots] == [mine["snapshot_id"]]
    # A crash and a restart: the user's segment (its file) is adopted, still the user's.
    shared_server.kill_and_start()
    assert [(s.job_id, s.adopted) for s in shared_server.admin.stats().sessions] == [("uid-job", True)]
    assert os.stat(mine["segment"]).st_uid == mine["uid"]
    again = _as(second, address, "probe", f"{mine['session_id']}:{mine['generation']}", mine["segment"])
    assert (again["attach"], again["detach"]) == ("PERMISSION_DENIED",) * 2
