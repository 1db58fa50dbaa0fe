"""The admin CLI and the client's hints agree with the server's defaults and fit this machine."""

from __future__ import annotations

import os
import subprocess
import sys

from swap_state.client.cli import build_parser
from swap_state.client.remote.rpc import start_hint
from swap_state.common.addresses import default_listen


def test_status_without_server_uses_the_servers_default_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("SWAP_STATE_SERVER", raising=False)
    assert build_parser().parse_args(["status"]).server == default_listen()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "SWAP_STATE_SERVER"}
    result = subprocess.run([sys.executable, "-m", "swap_state.client.cli", "status", "--timeout", "2"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert f"unix://{tmp_path}/swap-state/swap-state.sock" in said and "swap-state-server --shm-size" in said, said


def test_the_start_hint_fits_the_shm_dir_and_names_insecure_for_tcp(tmp_path):
    hint = start_hint("unix:///tmp/x.sock", shm_dir="/dev/shm")
    stat = os.statvfs("/dev/shm")
    total = stat.f_frsize * stat.f_blocks
    size = hint.split("--shm-size ")[1].split()[0]
    value = int(size[:-1]) << (30 if size.endswith("G") else 20)
    assert value <= max(total, 64 << 30) and "--insecure" not in hint
    assert "--listen tcp://127.0.0.1:7070 --insecure" in start_hint("tcp://127.0.0.1:7070")
    if 2 << 30 <= total < 128 << 30:  # a size taken from the host says why
        assert "(half of this host's /dev/shm: size it to the moments" in hint
