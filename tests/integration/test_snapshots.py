"""Server-side snapshots against a real server process, socket and shared memory: exactness
while the trainer keeps stepping, restore, faults, export and the operator's command line.

The snapshot files are read with the ``safetensors`` library only; "bitwise" compares bytes.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings

import grpc
import pytest
import torch
from safetensors.torch import load_file

from swap_state.client import cli
from swap_state.client.remote.container import PARAM_STEPS
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient, SwapStateError
from swap_state.common.snapshot_format import RankManifest

from snapshot_kit import (
    CHUNK,
    bitwise_diff,
    build_wide,
    data_file,
    flip_byte_of_tensor,
    moment_bytes,
    params_copy,
    rank_manifest,
    record_state,
    reference,
    swap_state_cli,
    tiny_tmpfs,
)
from .workload import Workload, mismatches, remote, train

pytestmark = pytest.mark.integration

W = Workload()
#: Writer cap that makes persisting a WideNet (~0.55 MiB of moments) take ~1 s.
SLOW = "512K"


def _client(server) -> SwapStateClient:
    return SwapStateClient(ClientConfig(server.address))


def _moment_keys(state: dict) -> list[str]:
    return [k for k in state if k.startswith("state.")]


# -- 1. consistency under load ------------------------------------------------------------------


@pytest.mark.parametrize(
    "cow_budget", [None, "128K"], ids=["spare-pool-for-every-chunk", "two-slots-back-pressure"]
)
def test_snapshot_holds_step_n_bitwise_while_trainer_steps_on(start_server, cow_budget):
    extra = {"cow_budget": cow_budget} if cow_budget else {}
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth=SLOW, **extra)  # 64 KiB: a page multiple
    model = build_wide(W)
    container = remote(W, model, server.address, "load")
    train(model, container, W, range(1, 4))
    at_n = record_state(model, container)  # step 3, copied before the snapshot
    handle = container.snapshot()
    assert handle.step == 3
    train(model, container, W, range(4, 7))  # while the capped writer still persists step 3
    live = record_state(model, container)
    # The trainer did overwrite every moment the writer had to read.
    assert all(not torch.equal(live[k], at_n[k]) for k in _moment_keys(at_n))

    status = handle.wait_durable(timeout_s=60)
    manifest = rank_manifest(status.path)
    assert manifest["step"] == 3 and manifest["chunk_bytes"] == CHUNK
    assert status.bytes_total >= moment_bytes(model) > 4 * CHUNK  # several chunks
    stored = load_file(str(data_file(status.path)))
    assert bitwise_diff(at_n, stored) == []
    # group steps of the snapshot are step 3's too
    assert stored["swap_state.group_steps"].tolist() == [3.0]

    # the old bytes survived: the server staged them ahead of the trainer, or the trainer copied
    assert status.cow_copies + status.server_staged_chunks > 0
    if cow_budget is None:
        # A pool for every chunk: the server's stager makes chunks safe at memory speed, so the
        # trainer (stepping at once here, with no forward/backward to give the stager a head
        # start) waits at most briefly, when its own fallback slot is taken.
        assert status.backpressure_wait_seconds < 2.0, status
    else:
        assert status.backpressure_waits > 0 and status.backpressure_wait_seconds > 0
    # ... and the snapshot's own record says the same
    assert (manifest["cow_copies"], manifest["backpressure_waits"]) == (
        status.cow_copies,
        status.backpressure_waits,
    )

    ref_model, ref_opt = reference(W, build_wide, 6)
    assert mismatches(model, container, ref_model, ref_opt) == []
    container.close()


def test_back_to_back_snapshots_wait_for_the_previous_one_and_both_are_exact(start_server):
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth=SLOW)
    model = build_wide(W)
    container = remote(W, model, server.address, "b2b")
    train(model, container, W, range(1, 3))
    at_2 = record_state(model, container)
    first = container.snapshot()
    train(model, container, W, range(3, 4))
    at_3 = record_state(model, container)
    second = container.snapshot()  # the server persists one snapshot of a segment at a time
    assert first.status().state == "durable"  # ... so this one waited for the first
    status_2 = first.wait_durable(timeout_s=60)
    status_3 = second.wait_durable(timeout_s=60)
    assert bitwise_diff(at_2, load_file(str(data_file(status_2.path)))) == []
    assert bitwise_diff(at_3, load_file(str(data_file(status_3.path)))) == []
    train(model, container, W, range(4, 6))
    ref_model, ref_opt = reference(W, build_wide, 5)
    assert mismatches(model, container, ref_model, ref_opt) == []
    container.close()


# -- 2. restore, then continue --------------------------------------------------------------------


def test_restore_latest_then_continue_is_bitwise_an_uninterrupted_run(start_server):
    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, server.address, "again")
    train(model, container, W, range(1, 6))
    params_at_5 = params_copy(model)
    container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(6, 9))

    assert container.restore("latest") == 5
    # The RPCs take a step in either spelling, and answer with the short id.
    for snapshot_id in ("again/step-000000000005", "step-05"):
        assert container.restore(snapshot_id) == 5
    status = container.client.snapshot_status("again/step-000000000005", 0)
    assert (status.snapshot_id, status.state) == ("again/step-5", "durable")
    assert container.session.last_committed_step == 5
    model.load_state_dict(params_at_5)
    train(model, container, W, range(6, 11))

    ref_model, ref_opt = reference(W, build_wide, 10)
    assert mismatches(model, container, ref_model, ref_opt) == []
    container.close()


def test_restore_into_fresh_server_on_the_same_snapshot_dir(start_server):
    first = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, first.address, "moved")
    train(model, container, W, range(1, 6))
    params_at_5 = params_copy(model)
    container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(6, 8))
    container.close()
    first.kill()  # a crashed host process: its snapshot dir stays

    second = start_server(chunk_bytes=CHUNK, snapshot_dir=first.snapshot_dir)
    fresh_model = build_wide(Workload(seed=7))  # other initial values: all must come back
    fresh_model.load_state_dict(params_at_5)
    fresh = remote(W, fresh_model, second.address, "moved")
    assert fresh.restore("latest") == 5
    assert "streamed=true" in second.log_text()  # a new trainer's segment: copied as verified
    train(fresh_model, fresh, W, range(6, 11))

    ref_model, ref_opt = reference(W, build_wide, 10)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    fresh.close()


# -- 3. faults ------------------------------------------------------------------------------------


def test_server_sigkilled_mid_persist_lists_nothing_new_and_previous_restores(start_server):
    first = start_server(chunk_bytes=CHUNK, persist_max_bandwidth=SLOW)
    model = build_wide(W)
    container = remote(W, model, first.address, "killed")
    train(model, container, W, range(1, 4))
    params_at_3 = params_copy(model)
    container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(4, 7))
    handle = container.snapshot()
    status = handle.status()
    assert status.state == "persisting" and status.bytes_persisted < status.bytes_total
    first.kill()
    container.close()

    job_dir = pathlib.Path(first.snapshot_dir) / "killed"
    second = start_server(chunk_bytes=CHUNK, snapshot_dir=first.snapshot_dir)
    client = _client(second)
    listed = client.list_snapshots("killed").snapshots
    client.close()
    assert [(s.snapshot_id, s.step, s.latest) for s in listed] == [("killed/step-3", 3, True)]
    assert sorted(os.listdir(job_dir)) == ["latest", "step-000000000003"]  # the partial is gone

    fresh_model = build_wide(Workload(seed=7))
    fresh_model.load_state_dict(params_at_3)
    fresh = remote(W, fresh_model, second.address, "killed")
    assert fresh.restore("latest") == 3
    train(fresh_model, fresh, W, range(4, 9))
    ref_model, ref_opt = reference(W, build_wide, 8)
    assert mismatches(fresh_model, fresh, ref_model, ref_opt) == []
    fresh.close()


def test_flipped_byte_refuses_restore_naming_file_and_tensor(start_server):
    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, server.address, "flip")
    train(model, container, W, range(1, 5))
    status = container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(5, 7))  # the live state now differs from the snapshot
    live = record_state(model, container)
    path = data_file(status.path)
    flip_byte_of_tensor(path, "state.mid.weight.exp_avg_sq", at=CHUNK + 5)  # in its 2nd chunk

    with pytest.raises(SwapStateError) as info:
        container.restore(status.snapshot_id)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert str(path) in str(info.value) and "'state.mid.weight.exp_avg_sq'" in str(info.value)

    assert bitwise_diff(live, record_state(model, container)) == []  # the cache is untouched
    assert container.session.last_committed_step == 6
    train(model, container, W, range(7, 9))  # steps included: training goes on as if nothing
    ref_model, ref_opt = reference(W, build_wide, 8)
    assert mismatches(model, container, ref_model, ref_opt) == []
    container.close()


def test_a_new_trainers_failed_restore_leaves_its_state_fresh(start_server):
    """Its segment held nothing: the server copied each tensor as verified, and zeroed them on failure."""
    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    first = remote(W, model, server.address, "fresh")
    train(model, first, W, range(1, 5))
    status = first.snapshot().wait_durable(timeout_s=60)
    first.close()
    flip_byte_of_tensor(data_file(status.path), "state.mid.weight.exp_avg_sq", at=CHUNK + 5)

    model = build_wide(W)
    container = remote(W, model, server.address, "fresh")
    with pytest.raises(SwapStateError) as info:
        container.restore("latest")
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "'state.mid.weight.exp_avg_sq'" in str(info.value)
    assert container.session.last_committed_step is None and container.segment.torn_step is None
    train(model, container, W, range(1, 4))  # as a new run: from zero moments
    ref_model, ref_opt = reference(W, build_wide, 3)
    assert mismatches(model, container, ref_model, ref_opt) == []
    container.close()


@pytest.mark.parametrize("running", [False, True], ids=["new-trainer", "running-trainer"])
def test_a_restore_without_an_answer_leaves_the_state_torn(start_server, running):
    """No answer (the server gone): the trainer cannot know what reached its segment (a running
    trainer's kept state is copied in as read, and put back only by a server that saw the failure)."""
    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, server.address, "unanswered")
    if running:
        train(model, container, W, range(1, 2))
    server.kill()
    with pytest.raises(SwapStateError):
        container.restore("latest")
    assert container.segment.torn_step == 0
    with pytest.raises(SwapStateError, match="a restore or a load replacing the whole state did not finish"):
        train(model, container, W, range(1, 2))
    container.close()


def test_disk_full_fails_the_snapshot_clearly_and_training_goes_on(start_server, tmp_path):
    with tiny_tmpfs(tmp_path / "small", "128k") as small:
        server = start_server(chunk_bytes=CHUNK, snapshot_dir=str(small))
        model = build_wide(W)
        assert moment_bytes(model) > 4 * (128 << 10)
        container = remote(W, model, server.address, "full")
        train(model, container, W, range(1, 4))
        handle = container.snapshot()  # consistent: the disk is only found full while writing
        train(model, container, W, range(4, 6))
        with pytest.raises(SwapStateError) as info:
            handle.wait_durable(timeout_s=60)
        message = str(info.value)
        assert "full/step-3" in message
        assert f"snapshot directory {small} is full" in message and "training is unaffected" in message

        train(model, container, W, range(6, 9))
        ref_model, ref_opt = reference(W, build_wide, 8)
        assert mismatches(model, container, ref_model, ref_opt) == []
        client = _client(server)
        assert list(client.list_snapshots("full").snapshots) == []
        client.close()
        assert [p.name for p in (small / "full").iterdir()] == []  # the partial files are gone
        container.close()
        server.stop()


# -- 5. export ------------------------------------------------------------------------------------


def _seed_state_dict(container) -> dict:
    """The container's full-mode state dict, copied (its moments are views of shared memory)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in container.state_dict().items()}


def _assert_same_state_dict(expected: dict, actual: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        got = actual[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert bitwise_diff({key: value}, {key: got}) == [], key
        else:
            assert got == value and type(got) is type(value), (key, got, value)


def test_export_torch_and_dcp_match_the_seed_state_dict_at_that_step(start_server, tmp_path):
    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, server.address, "exp", rank=0, world_size=1)
    train(model, container, W, range(1, 5))
    expected = _seed_state_dict(container)
    assert "state.mid.weight.exp_avg" in expected and "param_groups.mid.weight.lr" in expected
    status = container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(5, 7))
    container.close()

    out = tmp_path / "opt.pt"
    done = swap_state_cli("export", status.path, "--format", "torch", str(out))
    assert done.returncode == 0, done.stderr
    _assert_same_state_dict(expected, torch.load(out, weights_only=True))

    import torch.distributed.checkpoint as dcp

    out_dcp = tmp_path / "opt-dcp"
    assert cli.main(["export", status.path, "--format", "dcp", str(out_dcp)]) == 0
    template = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist
        dcp.load(template, checkpoint_id=str(out_dcp), no_dist=True)
    _assert_same_state_dict(expected, template)


def test_export_of_a_missing_or_corrupt_snapshot_says_why(start_server, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x.pt")]) == 1
    assert "is not a snapshot directory" in capsys.readouterr().err

    server = start_server()
    model = build_wide(W)
    container = remote(W, model, server.address, "bad")
    train(model, container, W, range(1, 3))
    status = container.snapshot().wait_durable(timeout_s=60)
    container.close()
    flip_byte_of_tensor(data_file(status.path), "state.head.weight.exp_avg")
    assert cli.main(["export", status.path, str(tmp_path / "y.pt")]) == 1
    err = capsys.readouterr().err
    assert "'state.head.weight.exp_avg' fails its checksum" in err
    assert not (tmp_path / "y.pt").exists()


# -- 6. the operator's view ----------------------------------------------------------------------


def test_cli_status_shows_a_running_snapshot_and_snapshots_lists_it(start_server):
    server = start_server(chunk_bytes=CHUNK, persist_max_bandwidth="256K")
    model = build_wide(W)
    container = remote(W, model, server.address, "ops")
    train(model, container, W, range(1, 3))
    handle = container.snapshot()

    status = swap_state_cli("status", "--server", server.address)
    assert status.returncode == 0, status.stderr
    assert "sessions: 1" in status.stdout
    assert "ops/rank 0/1 " in status.stdout and "last step 2" in status.stdout
    assert "budget: used " in status.stdout
    assert "snapshot ops/step-2 rank 0: persisting" in status.stdout

    durable = handle.wait_durable(timeout_s=60)
    listed = swap_state_cli("snapshots", "--server", server.address, "--job-id", "ops")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ops/step-2\t1 ranks\t")
    assert lines[0].endswith(f"{durable.path} (latest)")
    other = swap_state_cli("snapshots", "--server", server.address, "--job-id", "nobody")
    assert other.returncode == 0 and other.stdout.strip() == "no snapshots"
    # One snapshot, its step in either spelling; the short id is what is printed.
    for named in (["ops/step-2"], ["ops/step-000000000002"], ["--job-id", "ops", "step-02"]):
        one = swap_state_cli("snapshots", "--server", server.address, *named)
        assert one.returncode == 0 and one.stdout.strip() == lines[0], (named, one.stdout, one.stderr)
    missing = swap_state_cli("snapshots", "--server", server.address, "ops/step-000000000003")
    assert missing.returncode == 0 and missing.stdout.strip() == "no snapshot ops/step-3"
    bad = swap_state_cli("snapshots", "--server", server.address, "ops/3")
    assert bad.returncode == 2 and "swap-state snapshots: snapshot id 'ops/3' is not" in bad.stderr

    status = swap_state_cli("status", "--server", server.address)
    assert "snapshot ops/" not in status.stdout  # nothing running any more
    container.close()


def test_swap_state_entry_point_is_this_cli():
    import tomllib

    pyproject = pathlib.Path(__file__).parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["swap-state"] == "swap_state.client.cli:main"


# -- metadata in parts ----------------------------------------------------------------------------


def test_metadata_base_goes_once_and_a_server_that_lost_it_gets_it_again(start_server):
    """The parts expand to exactly the whole metadata; the base travels with the first
    snapshot only; a server that does not hold it refuses with METADATA_BASE_UNKNOWN and the
    container sends it again."""
    from swap_state.client.errors import MetadataBaseUnknownError
    from swap_state.common.snapshot_metadata_parts import base_id, parse_base, parse_delta

    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, server.address, "parts")
    train(model, container, W, range(1, 3))
    ident, base, delta = container.store.metadata.parts(container.segment.views[PARAM_STEPS])
    tensors = container.segment.mapping.tensors
    assert parse_delta(delta, parse_base(base, tensors)).expand().raw == container.snapshot_metadata()
    sent = []
    real = container.session.snapshot

    def spy(step, **kwargs):
        sent.append(sorted(k for k, v in kwargs.items() if v and k.startswith("metadata")))
        return real(step, **kwargs)

    container.session.snapshot = spy
    first = container.snapshot().wait_durable(timeout_s=60)
    train(model, container, W, range(3, 4))
    second = container.snapshot().wait_durable(timeout_s=60)
    assert sent == [["metadata_base_id", "metadata_base_json", "metadata_delta_json"],
                    ["metadata_base_id", "metadata_delta_json"]]
    assert rank_manifest(second.path)["step"] == 3 and rank_manifest(first.path)["step"] == 2
    manifest = rank_manifest(second.path)
    assert json.loads(RankManifest.from_json(manifest).metadata_json) == json.loads(container.snapshot_metadata())

    with pytest.raises(MetadataBaseUnknownError, match="does not hold the snapshot metadata base"):
        real(3, metadata_base_id="0" * 32, metadata_delta_json=delta)
    # A base the server never saw (as after its restart): refused once, then sent along.
    other = json.dumps(json.loads(base), indent=1)  # the same base, another text and digest
    container.store.metadata._base = (base_id(other), other)
    sent.clear()
    train(model, container, W, range(4, 5))
    third = container.snapshot().wait_durable(timeout_s=60)
    assert sent == [["metadata_base_id", "metadata_delta_json"],
                    ["metadata_base_id", "metadata_base_json", "metadata_delta_json"]]
    assert json.loads(RankManifest.from_json(rank_manifest(third.path)).metadata_json) == json.loads(
        container.snapshot_metadata())
    container.close()


@pytest.mark.parametrize("mode", ["writes", "off"])
def test_direct_io_flag_decides_how_snapshots_are_written(start_server, mode):
    server = start_server(chunk_bytes=CHUNK, direct_io=mode)
    model = build_wide(W)
    container = remote(W, model, server.address, f"direct-{mode}")
    train(model, container, W, range(1, 3))
    at_n = record_state(model, container)
    status = container.snapshot().wait_durable(timeout_s=60)
    assert bitwise_diff(at_n, load_file(str(data_file(status.path)))) == []
    [line] = [line for line in server.log_text().splitlines() if "snapshot_rank_persisted" in line]
    assert f"direct_io={str(mode == 'writes').lower()}" in line, line
    container.close()


def test_an_export_loads_into_plain_torch_adamw_and_trains_on_bitwise(start_server, tmp_path):
    """The README's example: ``swap-state export --format torch`` then torch's own
    ``set_optimizer_state_dict`` (the flat keys are torchtitan's) into ``torch.optim.AdamW``,
    which continues exactly as an uninterrupted AdamW run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    server = start_server(chunk_bytes=CHUNK)
    model = build_wide(W)
    container = remote(W, model, server.address, "to-adamw")
    train(model, container, W, range(1, 5))
    params_at_4 = params_copy(model)
    status = container.snapshot().wait_durable(timeout_s=60)
    container.close()
    out = tmp_path / "opt.pt"
    assert swap_state_cli("export", status.path, "--format", "torch", str(out)).returncode == 0

    plain = build_wide(Workload(seed=7))
    plain.load_state_dict(params_at_4)  # the parameters of that step (the snapshot holds the moments)
    optimizer = torch.optim.AdamW(plain.parameters(), fused=True, lr=1.0)  # lr etc. come from the export
    flat = torch.load(out, weights_only=True)
    set_optimizer_state_dict(plain, optimizer, flat, options=StateDictOptions(flatten_optimizer_state_dict=True))
    train(plain, optimizer, W, range(5, 9))

    ref_model, ref_opt = reference(W, build_wide, 8)
    assert mismatches(plain, _TorchStates(optimizer), ref_model, ref_opt) == []


class _TorchStates:
    """A torch optimizer's states where ``mismatches`` reads a container's host cache."""

    def __init__(self, optimizer):
        self.param_to_cpu_states_map = optimizer.state
