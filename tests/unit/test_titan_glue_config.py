"""The torchtitan glue, one layer at a time (no server): bad configuration, the embedded
server's snapshot directory, snapshot retention from the checkpoint config, the job-config
context of torchtitan's Trainer, and checkpoint-matched load templates through DCP."""

from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torchtitan.components.optimizer as tt_optimizer
from _swap_testing import ParityModel, assert_matches_reference, reference_optimizer, train, two_groups
from torchtitan.components.optimizer import OptimizersContainer

from swap_state.client.torchtitan import glue as torchtitan_glue
from swap_state.client.torchtitan.settings import embedded_snapshot_dir, snapshots_to_keep
from swap_state.client.optim.checkpoint_template import SnapshotCheckpointError, load_template
from swap_state.client.remote.embedded import EmbeddedServerConfig, default_snapshot_dir
from swap_state.client.remote.config import (
    RemoteConfig, embedded_config_for, embedded_world_size_hint, follow_checkpoint_retention, resolve_config,
    snapshot_retention,
)
from swap_state.client.swap_optimizer import SwapOptimizersContainer

pytestmark = pytest.mark.timeout(60)

KWARGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _config(**overrides: Any) -> types.SimpleNamespace:
    values = dict(
        swap_optimizer=True, name="AdamW", lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
        weight_decay=0.1, implementation="fused", swap_optimizer_times=2,
    )  # fmt: skip
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"swap_state_checkpoint": "both"}, r"optimizer\.swap_state_checkpoint must be one of 'full', 'snapshot', got 'both'"),
        ({"swap_optimizer_backend": "nvme"}, r"optimizer\.swap_optimizer_backend must be one of 'local', 'remote', got 'nvme'"),
        ({"swap_optimizer_times": 0}, r"optimizer\.swap_optimizer_times must be an integer >= 1, got 0"),
        ({"swap_optimizer_times": "8"}, r"optimizer\.swap_optimizer_times must be an integer >= 1, got '8'"),
        ({"implementation": "apex"}, r"optimizer\.implementation must be one of 'fused', 'foreach', 'for-loop'"),
        ({"swap_state_checkpoint": "snapshot"}, r"swap_optimizer_backend = 'remote'"),  # local backend
    ],
)
def test_bad_configuration_names_the_field_and_the_allowed_values(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tt_optimizer.build_optimizers([torch.nn.Linear(2, 2)], _config(**overrides), None, None)


def test_unknown_optimizer_still_says_not_added() -> None:
    with pytest.raises(NotImplementedError, match="Optimizer SGD not added."):
        tt_optimizer.build_optimizers([torch.nn.Linear(2, 2)], _config(name="SGD", swap_optimizer_times=0), None, None)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"checkpoint": "snap"}, r"RemoteConfig\.checkpoint must be one of 'full', 'snapshot', got 'snap'"),
        ({"snapshot_keep_latest": -1}, r"RemoteConfig\.snapshot_keep_latest must be None or an integer >= 0"),
    ],
)
def test_remote_config_is_validated(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_config(RemoteConfig(**overrides), "unix:///nowhere", "job")


def test_default_snapshot_dir_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_snapshot_dir() == str(tmp_path / "swap-state" / "snapshots")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the XDG spec: absolute only
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_snapshot_dir() == str(tmp_path / "home" / ".local" / "state" / "swap-state" / "snapshots")
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_snapshot_dir() == str(tmp_path / "home" / ".local" / "state" / "swap-state" / "snapshots")


def test_embedded_config_is_sized_and_per_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    sized = embedded_config_for(RemoteConfig(), [model], {}, rank=0, world_size=1)
    assert sized.shm_size_bytes is not None and sized.shm_size_bytes >= 64 << 20
    assert sized.snapshot_dir is None  # the EmbeddedServer's default: default_snapshot_dir()
    kept = embedded_config_for(
        RemoteConfig(embedded=EmbeddedServerConfig(shm_size_bytes=1 << 30, snapshot_dir=str(tmp_path))),
        [model], {}, rank=3, world_size=4,
    )  # fmt: skip
    assert kept.shm_size_bytes == 1 << 30 and kept.snapshot_dir == str(tmp_path / "rank-00003")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    default = embedded_config_for(RemoteConfig(), [model], {}, rank=1, world_size=2)
    assert default.snapshot_dir == str(tmp_path / "swap-state" / "snapshots" / "rank-00001")


def test_the_hint_for_embedded_snapshots_of_a_run_of_another_size(tmp_path: Path) -> None:
    """A one-rank rerun next to a two-rank run's rank directories, a two-rank rerun next to a
    one-rank run's, and nothing to say where neither run left the job."""
    (tmp_path / "rank-00000" / "job").mkdir(parents=True)
    (tmp_path / "rank-00001" / "job").mkdir(parents=True)
    alone = embedded_world_size_hint(str(tmp_path), "job", world_size=1)
    assert "taken by 2 ranks' embedded servers" in alone and f"--snapshot-dir {tmp_path})" in alone
    assert embedded_world_size_hint(str(tmp_path), "other", world_size=1) == ""
    (tmp_path / "solo").mkdir()
    two = embedded_world_size_hint(str(tmp_path / "rank-00001"), "solo", world_size=2)
    assert "taken by a one-rank run's embedded server" in two
    assert embedded_world_size_hint(str(tmp_path / "rank-00001"), "job", world_size=2) == ""


def test_embedded_server_for_whole_state_snapshots_has_copy_slots_for_the_whole_state() -> None:
    """The memory rule's worst case: a whole-state snapshot (a checkpoint) never makes the
    trainer copy or wait, whatever the disk; the budget holds the state and those slots."""
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of parameters, 8 MiB of moments
    whole = embedded_config_for(RemoteConfig(checkpoint="snapshot"), [model], {}, rank=0, world_size=1)
    state = 3 * sum(p.numel() * 4 for p in model.parameters())
    cow = whole.server["cow_budget"]
    assert cow >= state and whole.shm_size_bytes >= state + cow
    assert whole.server_config("unix:///tmp/x.sock", "/tmp/snaps").cow_budget == cow
    assert "cow_budget" not in embedded_config_for(RemoteConfig(), [model], {}, rank=0, world_size=1).server




@pytest.mark.parametrize(
    ("explicit", "keep_latest_k", "expected"),
    [(None, 3, {"keep_latest": 3}), (None, 0, {"keep_all": True}), (5, 3, {"keep_latest": 5})],
)
def test_snapshot_retention_follows_the_checkpoint_unless_set(
    explicit: int | None, keep_latest_k: int, expected: dict[str, Any]
) -> None:
    config = RemoteConfig(job_id="job", snapshot_keep_latest=explicit)
    assert snapshot_retention(config) == ({} if explicit is None else {"keep_latest": explicit})
    follow_checkpoint_retention(config, keep_latest_k)
    # ... and a step trained again overwrites its snapshot, as torchtitan its checkpoint
    assert snapshot_retention(config) == {**expected, "replace_existing": True}


def test_checkpoint_manager_tells_the_container_its_retention(tmp_path: Path) -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import Checkpoint as CheckpointConfig

    torchtitan_glue.install_job_hooks()
    torchtitan_glue.install_job_hooks()  # idempotent: wrapped once
    init = CheckpointManager.__init__
    assert not hasattr(getattr(init, "__swap_state_original__"), "__swap_state_original__")
    told: list[int] = []
    optimizers = types.SimpleNamespace(follow_checkpoint_retention=told.append)
    for enable, keep in ((True, 3), (False, 5)):
        config = CheckpointConfig(enable=enable, folder="ckpt", keep_latest_k=keep, async_mode="disabled")
        manager = CheckpointManager(
            dataloader=None, model_parts=[torch.nn.Linear(1, 1)], optimizers=optimizers,
            lr_schedulers=None, states={}, checkpoint_config=config, sd_adapter=None,
            base_folder=str(tmp_path),
        )  # fmt: skip
        manager.close()
    assert told == [4]  # keep_latest_k + 1 (torchtitan's last-step save does not purge); off: nothing


def test_snapshots_to_keep_covers_torchtitans_retention() -> None:
    assert [snapshots_to_keep(k) for k in (0, 2, 3, 10)] == [0, 3, 4, 11]


def test_trainer_init_makes_the_job_config_current(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    seen: list[Any] = []

    class Trainer:
        def __init__(self, job_config: Any) -> None:
            seen.append(torchtitan_glue.current_job_config.get())

    monkeypatch.setitem(sys.modules, "torchtitan.train", types.SimpleNamespace(Trainer=Trainer))
    torchtitan_glue.install_job_hooks()
    job = types.SimpleNamespace(job=types.SimpleNamespace(dump_folder="/runs/a"))
    Trainer(job)
    assert seen == [job] and torchtitan_glue.current_job_config.get() is None
    assert embedded_snapshot_dir(job.job.dump_folder) == "/runs/a/swap-state-snapshots"


def _plain_checkpoint(path: Path, steps: int = 5) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = ParityModel()
    plain = OptimizersContainer([model], torch.optim.AdamW, {**KWARGS, "fused": True})
    train(model, plain, range(steps))
    dcp.save({"optimizer": plain}, checkpoint_id=str(path))
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("pipeline", [False, True], ids=["inplace", "pipelined"])
def test_plain_checkpoint_loads_strictly_through_a_matched_template(tmp_path: Path, pipeline: bool) -> None:
    """torch's flattened AdamW dict (no group step; never-stepped params without state) into
    the swap container through a strict ``dcp.load``; then 5 more steps equal torch's 10."""
    model, params = _plain_checkpoint(tmp_path)
    fresh = ParityModel()
    fresh.load_state_dict(params)
    container = SwapOptimizersContainer(
        [fresh], torch.optim.AdamW, {**KWARGS, "fused": True}, 3, param_groups=two_groups, pipeline=pipeline
    )
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optimizer\.param_groups\..*\.step"):
        dcp.load({"optimizer": container}, checkpoint_id=str(tmp_path))  # the unmatched template
    with load_template(container, tmp_path):
        dcp.load({"optimizer": container}, checkpoint_id=str(tmp_path))
    train(fresh, container, range(5, 10))
    torch.manual_seed(0)
    ref_model = ParityModel()
    ref = reference_optimizer(ref_model, torch.optim.AdamW, KWARGS, None)
    train(ref_model, ref, range(10))
    assert_matches_reference(container, fresh, ref, ref_model)


def test_a_gap_in_the_checkpoint_still_fails_naming_the_key(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ParityModel()
    plain = OptimizersContainer([model], torch.optim.AdamW, {**KWARGS, "fused": True})
    train(model, plain, range(2))
    sd = plain.state_dict()
    del sd["state.proj.weight.exp_avg"]
    dcp.save({"optimizer": sd}, checkpoint_id=str(tmp_path))
    container = SwapOptimizersContainer([copy.deepcopy(model)], torch.optim.AdamW, dict(KWARGS), 2)
    with load_template(container, tmp_path), pytest.raises(CheckpointException, match=r"optimizer\.state\.proj\.weight\.exp_avg"):
        dcp.load({"optimizer": container}, checkpoint_id=str(tmp_path))


def test_snapshot_reference_into_a_plain_optimizer_names_swap_state_export(tmp_path: Path) -> None:
    sd = {"swap_state.snapshot_id": "run1/step-3", "swap_state.job_id": "run1", "state.w.step": torch.tensor(3.0)}
    dcp.save({"optimizer": sd}, checkpoint_id=str(tmp_path))
    plain = OptimizersContainer([torch.nn.Linear(2, 2)], torch.optim.AdamW, dict(KWARGS))
    with pytest.raises(SnapshotCheckpointError, match=r"run1/step-3.*swap-state export"):
        with load_template(plain, tmp_path):
            pass
