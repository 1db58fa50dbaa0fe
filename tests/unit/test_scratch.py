"""Scratch folders of killed processes are swept by the next one (client/remote/embedded.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from swap_state.client.remote.embedded import OWNER_FILE, OWNERLESS_GRACE_S, make_scratch_dir, sweep_stale


def test_a_dead_owners_folder_is_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "demo-stale"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(dead.stdout.strip())
    (stale / "segment").write_bytes(b"x" * 10)
    empty_old = tmp_path / "demo-old"  # an older version's leftover: empty, no owner file
    empty_old.mkdir()
    old = time.time() - OWNERLESS_GRACE_S - 1
    os.utime(empty_old, (old, old))
    being_made = tmp_path / "demo-new"  # another process's, between its mkdtemp and its owner file
    being_made.mkdir()
    busy_old = tmp_path / "demo-other"  # no owner file but not empty: not ours to judge
    busy_old.mkdir()
    (busy_old / "file").write_text("x")
    mine = make_scratch_dir("demo-", dir=str(tmp_path))
    assert not stale.exists() and not empty_old.exists() and busy_old.exists() and being_made.exists()
    assert (tmp_path / os.path.basename(mine) / OWNER_FILE).read_text() == str(os.getpid())
    assert sweep_stale("demo-", dir=str(tmp_path)) == []  # this process is alive: kept
