"""``bash scripts/demo.sh --torchtitan`` and ``--torchtitan03`` (scripts/demo_torchtitan.py) as a newcomer runs them:
torchtitan's own trainer on the CPU with swap-state in snapshot mode, SIGKILLed after a
checkpoint and resumed, ends bitwise equal to plain AdamW and leaves no scratch folder."""

from __future__ import annotations

import glob
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Both lines run on one xdist worker, in order (--dist loadfile): each checks that the other
# left no temp folder.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_server_env")]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo_torchtitan.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line", ["0.2", "0.3"])
def test_the_torchtitan_demo_resumes_bitwise_and_cleans_up(line):
    if line == "0.3":
        sys.path.insert(0, str(SCRIPT.parents[1] / "tests" / "torchtitan03"))
        from titan03_kit import locate_titan03_python, missing_reason

        reason = missing_reason(locate_titan03_python())
        if reason:
            pytest.skip(reason)
    pattern = str(Path(tempfile.gettempdir()) / "swap-state-titan-demo-*")
    before = set(glob.glob(pattern)) | set(glob.glob("/dev/shm/swap-state-titan-demo-*"))
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--line", line], capture_output=True,
                            text=True, timeout=280)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "resumed at step 3 after the kill; losses bitwise equal to plain AdamW: yes" in out, out[-4000:]
    after = set(glob.glob(pattern)) | set(glob.glob("/dev/shm/swap-state-titan-demo-*"))
    assert after <= before, after - before
