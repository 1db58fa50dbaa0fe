"""The demo's resume decisions and their messages, against a stand-in container (no server):
each refusal names its cause and the next step."""

from __future__ import annotations

import dataclasses
import types

import pytest

from swap_state.client import demo
from swap_state.client.demo import DemoConfig, ModelStore, build_model


class _Container:
    """What the demo's resume reads of a RemoteSwapOptimizersContainer."""

    def __init__(self, resumed_step=None, previous_session="", snapshots=(), restores_to=None):
        self.resumed_step = resumed_step
        self.segment = types.SimpleNamespace(torn_step=None, embedded=None)
        self.session = types.SimpleNamespace(rank=0, previous_session=previous_session)
        self.remote_config = types.SimpleNamespace(job_id="demo")
        listed = types.SimpleNamespace(snapshots=list(snapshots), store_error="")
        self.client = types.SimpleNamespace(list_snapshots=lambda job_id: listed)
        self.restores_to = restores_to
        self.restored: list[str] = []

    def restore(self, snapshot_id: str) -> int:
        self.restored.append(snapshot_id)
        return self.restores_to


def _resume(container, tmp_path=None, **config):
    cfg = DemoConfig(**config)
    store = ModelStore(str(tmp_path) if tmp_path is not None else None)
    return demo._resume(container, cfg, build_model(cfg), store)


def test_reattach_after_the_grace_period_says_why_and_what_instead(tmp_path):
    why = "the server freed the state of job demo rank 0 31.0 s ago (...) (reason=grace_expired)"
    with pytest.raises(SystemExit) as exit_info:
        _resume(_Container(previous_session=why), tmp_path, resume="reattach")
    message = str(exit_info.value)
    assert "the server has no state for job 'demo' rank 0: " + why in message
    assert "--resume latest" in message and "a longer --grace" in message


def test_reattach_with_nothing_known_still_names_the_causes(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        _resume(_Container(), tmp_path, resume="reattach")
    assert "a restarted server" in str(exit_info.value) and "--grace" in str(exit_info.value)


@pytest.mark.parametrize(
    "container",
    [_Container(resumed_step=1000), _Container(snapshots=["demo/step-1000"], restores_to=1000)],
    ids=["kept-moments", "snapshot"],
)
def test_auto_without_a_state_dir_says_what_the_state_dir_is_for(container):
    with pytest.raises(SystemExit) as exit_info:
        _resume(container, None, resume="auto")
    message = str(exit_info.value)
    assert "--resume auto: --state-dir was not given" in message
    assert "model parameters" in message and "None" not in message
    assert container.restored == []  # refused before the server's state changes


def test_auto_without_a_state_dir_and_nothing_on_the_server_starts_over():
    assert _resume(_Container(), None, resume="auto") == (0, "a fresh start")


@pytest.mark.parametrize("snapshot_id", ["demo/step-25", "demo/step-000000000025", "step-25"])
def test_resume_names_a_snapshot_in_either_spelling_and_prints_the_short_id(tmp_path, capsys, snapshot_id):
    cfg = DemoConfig()
    ModelStore(str(tmp_path)).save(build_model(cfg), 25, snapshot=True)
    container = _Container(restores_to=25)
    assert _resume(container, tmp_path, resume=snapshot_id) == (25, "snapshot demo/step-25")
    assert container.restored == [snapshot_id]
    assert "restored snapshot demo/step-25: step 25" in capsys.readouterr().out


def test_a_state_past_steps_leaves_nothing_to_train():
    with pytest.raises(SystemExit) as exit_info:
        demo._check_steps_left(DemoConfig(steps=20), 25, "snapshot demo/step-25")
    message = str(exit_info.value)
    assert "nothing left to train: the run resumed at step 25 (snapshot demo/step-25)" in message
    assert "--steps 20" in message and "--steps above 25" in message
    demo._check_steps_left(DemoConfig(steps=20), 5, "snapshot demo/step-5")  # 15 steps to go


def test_resume_takes_the_modes_and_snapshot_ids_and_refuses_the_rest(capsys):
    for value in ("none", "reattach", "latest", "auto", "demo/step-25", "step-000000000025"):
        assert demo.parse_args(["--resume", value]).resume == value
    with pytest.raises(SystemExit):
        demo.parse_args(["--resume", "yesterday"])
    assert "nor a snapshot id such as demo/step-25" in capsys.readouterr().err


def test_help_says_what_the_state_dir_holds_and_what_each_resume_does(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "model parameters of its last two steps" in text  # --state-dir
    for mode in ("none: from scratch", "reattach: the optimizer state the server kept",
                 "latest: restore the job's latest snapshot", "auto: reattach, else latest",
                 "demo/step-25"):
        assert mode in text


def test_every_flag_explains_itself_and_step_seconds_parses():
    from swap_state.common.server_flags import field_docs

    docs = field_docs(demo.DemoConfig)
    undocumented = [f.name for f in dataclasses.fields(demo.DemoConfig) if len(docs.get(f.name, "")) < 10]
    assert undocumented == []
    assert demo.parse_args(["--step-seconds", "0.25"]).step_seconds == 0.25


def test_the_demo_at_a_wrong_socket_fails_first_naming_the_path(tmp_path):
    """The first-day mistake: the demo stops with the path before it trains anything (its
    reference run comes after the attach), exit status 2. Its time is measured, not asserted:
    docs/benchmarks.md ("first-day fail-fast")."""
    import subprocess
    import sys

    wrong = tmp_path / "no-server.sock"
    proc = subprocess.run([sys.executable, "-m", "swap_state.client.demo", "--server", f"unix://{wrong}",
                           "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"there is no socket file {wrong}" in proc.stderr and "swap-state-server --shm-size" in proc.stderr
    assert "bitwise" not in proc.stdout and "step " not in proc.stdout
