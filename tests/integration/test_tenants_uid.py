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
client = SwapStateClient(ClientConfig(address, timeout_s=10.0))
out = {"uid": os.getuid()}
try:
    if action == "own":
        session = client.attach("uid-job", 0, 1)
        session.allocate([("w", "float32", [64, 64])])
        session.commit(1)
        snapshot_id = session.snapshot(1, "").snapshot_id
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


@pytest.fixture
def shared_server(users):
    """A root-run server whose socket and segments both users reach (--shm-group)."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-uid-"))
    shm = pathlib.Path(tempfile.mkdtemp(prefix="swap-state-uid-", dir="/dev/shm"))
    for path in (root, shm):
        path.chmod(0o755)
    sock = root / "s.sock"
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swap_state.server.cli", "--shm-size", "64M", "--listen", f"unix://{sock}",
         "--shm-dir", str(shm), "--shm-group", GROUP, "--snapshot-dir", str(root / "snapshots"),
         "--chunk-bytes", "64K"],
        stdout=subprocess.DEVNULL, stderr=log)
    client = SwapStateClient(ClientConfig(f"unix://{sock}", timeout_s=10.0, connect_timeout_s=30.0))
    try:
        client.wait_ready()
        yield f"unix://{sock}", client
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
        log.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _as(user: str, address: str, action: str, arg: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", AS_USER, address, user, action, arg],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_users_job_is_its_own(shared_server, users):
    address, admin = shared_server
    first, second = users
    mine = _as(first, address, "own")
    assert mine["state"] == "durable" and mine["uid"] != 0
    theirs = _as(second, address, "probe", f"{mine['session_id']}:{mine['generation']}")
    assert theirs["uid"] not in (0, mine["uid"])
    assert (theirs["attach"], theirs["detach"], theirs["status"]) == ("PERMISSION_DENIED",) * 3
    assert theirs["listed"] == [] and theirs["sessions"] == []
    # Root is an admin: it sees the first user's session and snapshot.
    assert [s.job_id for s in admin.stats().sessions] == ["uid-job"]
    assert [s.snapshot_id for s in admin.list_snapshots().snapshots] == [mine["snapshot_id"]]
