"""RemoteSwapOptimizersContainer against a real server process, socket and shared memory."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import signal
import sys
import time

import pytest
import torch

from swap_state.client.remote.rpc import ClientConfig, ServerUnavailableError, SwapStateClient, SwapStateError

from .conftest import shm_files
from .workload import Workload, build, mismatches, reference_mismatches, reference_optimizer, remote, train

WORKLOAD = os.path.join(os.path.dirname(__file__), "workload.py")


def _spawn_trainer(server, job: str, rank: int, world: int, w: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WORKLOAD, server.address, job, str(rank), str(world), json.dumps(w)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_two_trainer_processes_share_one_server_bitwise(server):
    specs = [{"two_groups": True}, {"amsgrad": True, "seed": 1}]
    procs = [_spawn_trainer(server, "two", rank, 2, w) for rank, w in enumerate(specs)]
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"mismatches": [], "committed": 10}


@pytest.mark.parametrize("w", [Workload(), Workload(amsgrad=True, two_groups=True)], ids=["adamw", "amsgrad-2groups"])
def test_in_process_bitwise_and_no_rpc_per_step(server, w):
    model, ref_model = build(w), build(w)
    container = remote(w, model, server.address, "one")
    calls = []
    real_call = container.client.call
    container.client.call = lambda name, *a, **k: calls.append(name) or real_call(name, *a, **k)
    ref = reference_optimizer(w, ref_model)
    train(model, container, w, range(1, 11))
    train(ref_model, ref, w, range(1, 11))
    assert mismatches(model, container, ref_model, ref) == []
    assert calls == []  # the commit of a step is a header word: no RPC per step, tensor or chunk
    (session,) = [s for s in container.client.stats().sessions if s.job_id == "one"]
    assert (session.last_committed_step, session.steps_committed) == (10, 10)  # read off the header
    container.close()


def test_state_dict_round_trip_through_fresh_container_and_fresh_server(start_server):
    w = Workload()
    first = start_server()
    model = build(w)
    container = remote(w, model, first.address, "rt")
    train(model, container, w, range(1, 6))
    # The state dict's moments are views of shared memory: copy before the server goes.
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in container.state_dict().items()}
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    container.close()
    first.stop()

    second = start_server()
    model2 = build(w)
    model2.load_state_dict(saved_params)
    fresh = remote(w, model2, second.address, "rt")
    fresh.load_state_dict(saved)
    train(model2, fresh, w, range(6, 11))

    assert reference_mismatches(model2, fresh, w) == []
    fresh.close()


def _demo(server, tmp_path, *args, timeout=120):
    cmd = [sys.executable, "-m", "swap_state.client.demo", "--server", server.address,
           "--state-dir", str(tmp_path / "state"), "--report", str(tmp_path / "report.json"),
           "--steps", "10", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_reattach_after_sigkill_finishes_bitwise(server, tmp_path):
    crashed = _demo(server, tmp_path, "--job-id", "crash", "--crash-after-step", "5")
    assert crashed.returncode == -9, crashed.stderr
    assert "step    5" in crashed.stdout and "step    6" not in crashed.stdout
    resumed = _demo(server, tmp_path, "--job-id", "crash", "--resume", "reattach")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "reattached: the server kept the moments of step 5" in resumed.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["digest"] == report["reference_digest"]


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_demo_resumes_say_what_to_do_after_the_grace_period_and_past_steps(start_server, tmp_path):
    server = start_server(grace=1.0)
    crashed = _demo(server, tmp_path, "--job-id", "late", "--crash-after-step", "7")
    assert crashed.returncode == -9, crashed.stderr
    client = SwapStateClient(ClientConfig(server.address))
    try:
        _wait_for(lambda: client.list_snapshots("late").snapshots, "the step-5 snapshot")
        _wait_for(lambda: not client.stats().sessions, "the session freed after --grace")
    finally:
        client.close()

    late = _demo(server, tmp_path, "--job-id", "late", "--resume", "reattach")
    assert late.returncode == 1, late.stdout + late.stderr
    assert ("the server has no state for job 'late' rank 0: the server freed the state of job "
            "late rank 0 ") in late.stderr
    assert "last committed step 7" in late.stderr and "(reason=grace_expired)" in late.stderr
    assert "--resume latest" in late.stderr and "a longer --grace" in late.stderr

    short = _demo(server, tmp_path, "--job-id", "late", "--resume", "latest", "--steps", "4")
    assert short.returncode == 1, short.stdout + short.stderr
    assert ("nothing left to train: the run resumed at step 5 (snapshot late/step-5) and "
            "--steps 4") in short.stderr
    assert "nan" not in short.stdout and "bitwise" not in short.stdout

    padded = _demo(server, tmp_path, "--job-id", "late", "--resume", "late/step-000000000005")
    assert padded.returncode == 0, padded.stdout + padded.stderr
    assert "restored snapshot late/step-5: step 5" in padded.stdout
    assert "bitwise equal to plain AdamW: yes" in padded.stdout


def test_a_container_after_the_grace_period_logs_why_it_starts_fresh(start_server, caplog):
    server = start_server(grace=0.5)
    w = Workload()
    model = build(w)
    first = remote(w, model, server.address, "expired")
    train(model, first, w, range(1, 3))
    first.close(keep=True)  # kept for --grace, then freed
    client = SwapStateClient(ClientConfig(server.address))
    try:
        _wait_for(lambda: not client.stats().sessions, "the session freed after --grace")
    finally:
        client.close()
    with caplog.at_level(logging.INFO, logger="swap_state.client"):
        second = remote(w, build(w), server.address, "expired")
    assert second.resumed_step is None
    assert "(reason=grace_expired)" in second.session.previous_session
    assert ("no swap-state optimizer state kept for this trainer: the server freed the state of "
            "job expired rank 0 ") in caplog.text
    assert "last committed step 2" in caplog.text
    second.close()


def test_unreachable_server_names_address_and_command(tmp_path):
    address = f"unix://{tmp_path}/nobody.sock"
    w = Workload()
    with pytest.raises(ServerUnavailableError) as info:
        remote(w, build(w), address, "x", connect_timeout_s=1.0)
    assert address in str(info.value)
    assert "swap-state-server --shm-size" in str(info.value)


def test_wrong_token_message_reaches_user(start_server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    guarded = start_server(token_file=str(token_file))
    w = Workload()
    with pytest.raises(SwapStateError) as info:
        remote(w, build(w), guarded.address, "tok", token="wrong")
    assert "UNAUTHENTICATED" in str(info.value)
    ok = remote(w, build(w), guarded.address, "tok", token="right-token")
    ok.close()


def test_budget_exhausted_message_reaches_user(start_server):
    small = start_server(shm_size_bytes=8 << 20)
    torch.manual_seed(0)
    big = torch.nn.Linear(1024, 1024)  # 8 MiB of moments: more than the budget
    from swap_state.client.remote.container import RemoteSwapOptimizersContainer

    with pytest.raises(SwapStateError) as info:
        RemoteSwapOptimizersContainer([big], torch.optim.AdamW, {"lr": 1e-3}, 2, server=small.address, job_id="big")
    assert "RESOURCE_EXHAUSTED" in str(info.value)
    assert "--shm-size" in str(info.value) or "free" in str(info.value)


def test_budget_returns_to_zero_after_close(server):
    w = Workload()
    container = remote(w, build(w), server.address, "budget")
    assert container.server_stats().budget_used_bytes > 0
    container.close()
    from swap_state.client.remote.rpc import ClientConfig, SwapStateClient

    client = SwapStateClient(ClientConfig(server.address))
    stats = client.stats()
    client.close()
    assert stats.sessions == [] or all(s.segment_bytes == 0 for s in stats.sessions)
    assert stats.budget_used_bytes == 0


def test_embedded_default_leaves_nothing_behind(no_server_env):
    w = Workload()
    model = build(w)
    container = remote(w, model, None, None)
    embedded = container.segment.embedded
    assert embedded is not None
    pid, workdir = embedded.pid, embedded.workdir
    session_id = container.session.session_id
    # Segment files are named after the session (other tests' servers may share /dev/shm).
    assert any(session_id in name for name in shm_files("/dev/shm"))
    train(model, container, w, range(1, 3))
    assert container.session.last_committed_step == 2
    container.close()
    assert not os.path.exists(workdir)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not any(session_id in name for name in shm_files("/dev/shm"))


def test_two_containers_in_one_process_share_nothing(server):
    w = Workload()
    a_model, b_model = build(w), build(Workload(seed=3))
    a = remote(w, a_model, server.address, "a")
    b = remote(w, b_model, server.address, "b")
    plain_model = build(w)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    train(a_model, a, w, range(1, 3))
    assert not set(a.param_to_cpu_states_map) & set(b.param_to_cpu_states_map)
    assert all(float(h["step"]) == 0 for h in b.param_to_cpu_states_map.values())
    train(plain_model, plain, w, range(1, 3))
    assert all(s["exp_avg"].untyped_storage().size() > 0 for s in plain.state.values())
    assert type(plain).step is torch.optim.AdamW.step
    a.close()
    b.close()


def test_trainer_dead_mid_step_leaves_torn_state_that_must_be_restored(server):
    from swap_state.common.segment import Word

    w = Workload()
    model = build(w)
    first = remote(w, model, server.address, "torn")
    train(model, first, w, range(1, 4))
    first.snapshot().wait_durable(timeout_s=30)
    params_at_3 = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, first, w, range(4, 5))
    # What a trainer killed while writing step 5 leaves behind: the writing mark.
    first.segment.mapping.header[Word.WRITING_STEP] = 5 + 1
    first.close(keep=True)

    model2 = build(w)
    second = remote(w, model2, server.address, "torn")
    assert second.resumed_step is None
    with pytest.raises(SwapStateError, match="torn"):
        train(model2, second, w, range(5, 6))
    second.zero_grad()  # the refused step's gradients
    assert second.restore("latest") == 3
    model2.load_state_dict(params_at_3)
    train(model2, second, w, range(4, 11))
    assert reference_mismatches(model2, second, w) == []
    second.close()


def test_dtensor_parameter_bitwise_and_layout_in_snapshot_manifest(server, gloo_one_rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from swap_state.client.remote.container import RemoteSwapOptimizersContainer

    mesh = DeviceMesh("cpu", [0])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 6, bias=False)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    ref = torch.nn.Parameter(model.weight.to_local().detach().clone())
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    container = RemoteSwapOptimizersContainer([model], torch.optim.AdamW, dict(kw), 2, server=server.address, job_id="dt")
    ref_opt = torch.optim.AdamW([ref], fused=True, **kw)
    for step in range(1, 6):
        grad = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        model.weight.grad = DTensor.from_local(grad.clone(), mesh, [Shard(0)])
        ref.grad = grad.clone()
        container.step()
        ref_opt.step()
    assert torch.equal(model.weight.to_local(), ref)
    host = container.param_to_cpu_states_map[model.weight]
    assert torch.equal(host["exp_avg"], ref_opt.state[ref]["exp_avg"])
    assert torch.equal(host["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])
    reply = container.snapshot().wait_durable(timeout_s=30)
    manifest = json.loads(open(os.path.join(reply.path, "rank-00000.manifest.json")).read())
    records = {t["name"]: t for t in manifest["tensors"]}
    assert records["state.weight.exp_avg"]["global_shape"] == [6, 8]
    assert records["state.weight.exp_avg"]["global_offset"] == [0, 0]
    container.close()


def test_trainer_killed_between_its_last_write_and_its_commit_resumes_at_the_written_step(server):
    w = Workload()
    model = build(w)
    first = remote(w, model, server.address, "lost-commit")
    train(model, first, w, range(1, 4))
    first.session.commit = lambda step: step  # step 4's CommitStep never reaches the server
    train(model, first, w, range(4, 5))
    params_at_4 = {k: v.clone() for k, v in model.state_dict().items()}
    first.close(keep=True)

    model2 = build(w)
    second = remote(w, model2, server.address, "lost-commit")
    assert second.resumed_step == 4
    assert second.session.last_committed_step == 4  # committed on reattach
    model2.load_state_dict(params_at_4)
    train(model2, second, w, range(5, 11))
    assert reference_mismatches(model2, second, w) == []
    second.close()


_WITH_CTRL_C = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "runpy.run_module('swap_state.client.demo', run_name='__main__', alter_sys=True)")
"""``python -c`` running the demo with Python's own SIGINT handler."""


def test_ctrl_c_ends_the_demo_with_one_line_and_the_host_server_keeps_its_state(start_server, tmp_path):
    server = start_server()
    # As from a terminal: Ctrl-C delivered, whatever this runner ignores (a runner started in
    # the background by a non-interactive shell ignores SIGINT, and its children inherit that).
    demo = subprocess.Popen(
        [sys.executable, "-c", _WITH_CTRL_C, "--server", server.address, "--job-id", "ctrl-c",
         "--steps", "400", "--step-seconds", "0.1", "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert demo.stdout.readline().startswith("swap-state-server:")
        assert demo.stdout.readline().startswith("step    1")  # training: now the Ctrl-C
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        demo.kill()
    assert demo.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "demo: interrupted after step" in err and "keeps the optimizer state of job ctrl-c" in err
    assert f"--state-dir {tmp_path / 'state'} --resume auto" in err
    client = SwapStateClient(ClientConfig(server.address))
    try:
        [session] = [s for s in client.stats().sessions if s.job_id == "ctrl-c"]
        assert session.state == "orphaned" and session.has_committed_step
    finally:
        client.close()
