"""warm_start.py: a run forked from the warm server behaves as ``python SCRIPT`` would (argv,
environment, working directory, streams, exit code, a signal's death), and a run whose
import-time environment differs from the server's runs cold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warm_start import SOCKET_ENV

WARM_START = Path(__file__).resolve().parent / "warm_start.py"
SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
                  "env": os.environ.get("PROBE"), "stdin": sys.stdin.read(), "path0": sys.path[0],
                  "name": __name__}))
print("on stderr", file=sys.stderr)
if os.environ.get("PROBE") == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(os.environ.get("CODE", "0")))
"""

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path):
    path = tmp_path / "warm.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(WARM_START), "serve", str(path), "json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.02)
    yield path, env, proc.pid
    proc.kill()
    proc.wait()


def _run(tmp_path, env, *, warm: Path | None, stdin: str = "hello") -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    run_env = {**env, **({SOCKET_ENV: str(warm)} if warm else {})}
    argv = [sys.executable, str(WARM_START), "run", str(script), "a b", "--c"] if warm else \
        [sys.executable, str(script), "a b", "--c"]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=60)


def test_a_warm_run_is_the_script_run_in_a_child_of_the_server(server, tmp_path):
    path, env, server_pid = server
    warm = _run(tmp_path, {**env, "PROBE": "x", "CODE": "7"}, warm=path)
    cold = _run(tmp_path, {**env, "PROBE": "x", "CODE": "7"}, warm=None)
    assert warm.returncode == cold.returncode == 7, warm.stderr
    got, want = json.loads(warm.stdout), json.loads(cold.stdout)
    assert got["ppid"] == server_pid  # forked by the server, not run cold
    for key in ("argv", "cwd", "env", "stdin", "path0", "name"):
        assert got[key] == want[key], key
    assert warm.stderr == cold.stderr == "on stderr\n"


def test_a_run_killed_by_a_signal_kills_its_client_with_it(server, tmp_path):
    path, env, _ = server
    assert _run(tmp_path, {**env, "PROBE": "kill"}, warm=path).returncode == -signal.SIGKILL


def test_another_import_time_environment_runs_cold(server, tmp_path):
    path, env, server_pid = server
    cold = _run(tmp_path, {**env, "OMP_NUM_THREADS": "3"}, warm=path)
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout)["ppid"] != server_pid
