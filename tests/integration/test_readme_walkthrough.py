"""The README's walkthrough against a running server works pasted in order: its bash block,
run as it stands in one shell, with the venv's commands first on the PATH (as after
``. .venv/bin/activate``)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
MARK = "a test runs exactly these lines"


def walkthrough() -> str:
    text = README.read_text()
    after = text[text.index(MARK):]
    return re.search(r"```bash\n(.*?)```", after, re.S).group(1)


@pytest.mark.timeout(300)
def test_the_running_server_walkthrough_works_pasted_in_order(tmp_path, no_server_env):
    script = tmp_path / "walkthrough.sh"
    script.write_text(walkthrough())
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=280, env=env,
                          cwd=tmp_path)
    out = done.stdout
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step   12" in out and "reattached: the server kept the moments of step 12" in out, out[-3000:]
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("demo/step-")]
    assert listed == ["demo/step-5", "demo/step-10", "demo/step-15", "demo/step-20"], out[-3000:]
    assert "restored snapshot demo/step-10: step 10" in out, out[-3000:]
    assert out.count("parameters and moments bitwise equal to plain AdamW: yes") == 2, out[-3000:]
    assert not any(tmp_path.glob("tmp.*")), "the walkthrough removes its scratch folder"
