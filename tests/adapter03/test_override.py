"""The override target on a real torchtitan 0.3 trainer config: what it replaces, what it keeps,
how it combines with other targets, and its errors."""

from __future__ import annotations

import pytest
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.config import OverrideConfig, apply_overrides, derive, override
from torchtitan.trainer import Trainer

from swap_state.client.torchtitan.checkpoint_v03 import SwapStateCheckpointManager
from swap_state.client.torchtitan.optimizers_v03 import SwapStateOptimizersContainer
from swap_state.client.torchtitan.settings import SwapSettings
from swap_state.client.torchtitan_override import SETTINGS, with_swap_state

TARGET = "swap_state.client.torchtitan_override.swap_state"




@override(target=LRSchedulersContainer.Config, description="a test's own override")
def longer_warmup(config):
    return derive(config, type(config), warmup_steps=7)


def _trainer_config() -> Trainer.Config:
    config = Trainer.Config()
    config.optimizer.param_groups = [
        ParamGroupConfig(pattern=r"\.bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.1}),
    ]
    config.checkpoint = CheckpointManager.Config(enable=True, interval=3, keep_latest_k=2)
    return config


def test_the_target_replaces_optimizer_and_checkpoint_configs_and_keeps_their_fields():
    config = _trainer_config()
    groups = list(config.optimizer.param_groups)
    apply_overrides(OverrideConfig(imports=[(TARGET, {"swap_state_checkpoint": "snapshot"}), f"{__name__}.longer_warmup"]), config)
    assert type(config.optimizer) is SwapStateOptimizersContainer.Config
    assert config.optimizer.param_groups == groups and config.optimizer.implementation == "fused"
    assert config.optimizer.swap_state_checkpoint == "snapshot"
    assert config.optimizer.swap_optimizer_backend == "remote"  # the 0.3 default: the server
    assert type(config.checkpoint) is SwapStateCheckpointManager.Config
    assert (config.checkpoint.enable, config.checkpoint.interval, config.checkpoint.keep_latest_k) == (True, 3, 2)
    assert config.lr_scheduler.warmup_steps == 7  # the other target in the same flag applied too


def test_settings_are_the_0_2_names_plus_the_snapshot_dir():
    shared = [f for f in SwapSettings.__dataclass_fields__]
    assert list(SETTINGS) == [*shared, "swap_state_snapshot_dir"]


def test_a_registry_built_swap_config_keeps_its_settings_under_the_target():
    config = with_swap_state(_trainer_config(), swap_optimizer_times=4, swap_state_job_id="job-x")
    apply_overrides(OverrideConfig(imports=[(TARGET, {"swap_state_checkpoint": "snapshot"})]), config)
    assert (config.optimizer.swap_optimizer_times, config.optimizer.swap_state_job_id) == (4, "job-x")
    assert config.optimizer.swap_state_checkpoint == "snapshot"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"swap_state_chekpoint": "snapshot"}, "unknown setting(s) swap_state_chekpoint; the settings are swap_optimizer_times"),
        ({"swap_optimizer_backend": "gpu"}, "optimizer.swap_optimizer_backend must be one of 'local', 'remote', got 'gpu'"),
        ({"swap_optimizer_times": 0}, "optimizer.swap_optimizer_times must be an integer >= 1, got 0"),
        ({"swap_optimizer_backend": "local", "swap_state_checkpoint": "snapshot"}, "needs a swap-state server"),
        ({"swap_state_replica_interval": 2}, "optimizer.swap_state_replica_interval needs optimizer.swap_state_checkpoint"),
    ],
)
def test_bad_settings_fail_at_the_override_naming_them(settings, message):
    with pytest.raises(ValueError) as info:
        apply_overrides(OverrideConfig(imports=[(TARGET, settings)]), _trainer_config())
    assert message in str(info.value)


def test_the_0_2_entry_point_names_the_0_3_switch():
    from swap_state.client.torchtitan.version import WrongTorchtitanLine

    with pytest.raises(WrongTorchtitanLine, match="--override.imports swap_state.client.torchtitan_override.swap_state"):
        import swap_state.client.torchtitan_config  # noqa: F401
