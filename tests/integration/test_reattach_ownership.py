"""A reattach never trains on state that does not belong to the trainer's parameters.

A rerun with the same job id that starts from fresh weights (no checkpoint to load) finds the
previous run's kept segment: the kept moments are dropped (WARNING, counted) and it trains
exactly as fresh AdamW. A reattach whose parameters are the kept step's keeps them; a load
replaces them.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from swap_state.common.segment import Word

from .workload import Workload, build, reference_mismatches, remote, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_rerun_from_fresh_weights_drops_the_kept_state(server, caplog):
    w = Workload()
    first_model = build(w)
    first = remote(w, first_model, server.address, "rerun")
    train(first_model, first, w, range(1, 6))
    first.close(keep=True)  # what the exit hook does

    model = build(w)  # fresh weights, same seed: a rerun with nothing to load
    second = remote(w, model, server.address, "rerun")
    assert second.resumed_step == 5
    with caplog.at_level(logging.WARNING, logger="swap_state.client"):
        train(model, second, w, range(1, 6))
    assert reference_mismatches(model, second, w, steps=5) == []
    assert "dropping the swap-state optimizer state kept for job rerun rank 0 at step 5" in caplog.text
    assert second.resumed_step is None and second.session.last_committed_step == 5
    assert second.segment.mapping.header[Word.STATE_DROPS] == 1
    second.close()


def test_a_reattach_with_the_kept_steps_parameters_keeps_the_state(server, caplog):
    w = Workload()
    model = build(w)
    first = remote(w, model, server.address, "resume")
    train(model, first, w, range(1, 4))
    params_at_3 = {k: v.clone() for k, v in model.state_dict().items()}
    first.close(keep=True)

    model2 = build(w)
    model2.load_state_dict(params_at_3)
    second = remote(w, model2, server.address, "resume")
    with caplog.at_level(logging.WARNING, logger="swap_state.client"):
        train(model2, second, w, range(4, 11))
    assert "dropping" not in caplog.text
    assert reference_mismatches(model2, second, w) == []
    second.close()


def test_a_load_replaces_the_kept_state_without_a_check(server):
    w = Workload()
    model = build(w)
    first = remote(w, model, server.address, "loaded")
    train(model, first, w, range(1, 4))
    saved = {k: v.clone() if hasattr(v, "clone") else v for k, v in first.state_dict().items()}
    params_at_3 = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, first, w, range(4, 6))  # the kept segment moves on to step 5
    first.close(keep=True)

    model2 = build(w)
    model2.load_state_dict(params_at_3)
    second = remote(w, model2, server.address, "loaded")
    assert second.resumed_step == 5
    second.load_state_dict(saved)  # a checkpoint of step 3 replaces the kept step 5
    train(model2, second, w, range(4, 11))
    assert reference_mismatches(model2, second, w) == []
    assert second.segment.mapping.header[Word.STATE_DROPS] == 0
    second.close()


SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from integration.workload import Workload, build, reference_mismatches, remote, train
    w = Workload()
    model = build(w)
    container = remote(w, model, {address!r}, "script-rerun")
    train(model, container, w, range(1, 6))
    print(json.dumps(reference_mismatches(model, container, w, steps=5)))
    # no close(): the exit hook keeps the segment for a reattach, as a finished run does
    """
)


def test_running_a_script_twice_with_one_job_id_trains_fresh_both_times(server):
    tests_dir = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    code = SCRIPT.format(tests=tests_dir, address=server.address)
    for run in range(2):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], f"run {run + 1}"
        assert ("dropping the swap-state optimizer state" in proc.stderr) == (run == 1), proc.stderr
