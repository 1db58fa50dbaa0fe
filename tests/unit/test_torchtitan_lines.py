"""Each torchtitan line's entry point, imported under the other line, fails naming the switch
of the line that is installed; the settings both lines share keep one reading."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan (the client extra) is not installed")

from swap_state.client.torchtitan.settings import SwapSettings  # noqa: E402
from swap_state.client.torchtitan.version import WrongTorchtitanLine, torchtitan_line  # noqa: E402


@pytest.mark.skipif(torchtitan_line() != "0.2", reason="checks the 0.2 venv (tests/adapter03 checks 0.3's)")
def test_the_0_3_override_under_0_2_names_the_custom_config_module():
    with pytest.raises(WrongTorchtitanLine, match="custom_config_module=swap_state.client.torchtitan_config"):
        import swap_state.client.torchtitan_override  # noqa: F401


@pytest.mark.skipif(torchtitan_line() != "0.2", reason="checks the 0.2 venv (tests/adapter03 checks 0.3's)")
def test_0_2_cli_sets_the_settings_declared_once():
    """torchtitan 0.2 merges the [optimizer] section by its fields: the ones declared on
    SwapSettings reach its CLI with their defaults, and a value given there is read back."""
    from torchtitan.config.manager import ConfigManager

    parsed = ConfigManager().parse_args([
        "--job.custom_config_module=swap_state.client.torchtitan_config",
        "--optimizer.swap_state_server_wait_s", "5", "--optimizer.swap_optimizer_backend", "remote",
    ])
    settings = SwapSettings.of(parsed.optimizer)
    assert (settings.swap_state_server_wait_s, settings.swap_optimizer_backend) == (5.0, "remote")
    assert settings.swap_optimizer_times == SwapSettings().swap_optimizer_times


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"swap_optimizer_backend": "gpu"}, "optimizer.swap_optimizer_backend must be one of 'local', 'remote', got 'gpu'"),
        ({"swap_state_checkpoint": "all"}, "optimizer.swap_state_checkpoint must be one of 'full', 'snapshot', got 'all'"),
        ({"swap_optimizer_times": True}, "optimizer.swap_optimizer_times must be an integer >= 1, got True"),
        ({"swap_state_checkpoint": "snapshot"}, "set optimizer.swap_optimizer_backend = 'remote'"),
        ({"swap_state_replica_interval": -1}, "optimizer.swap_state_replica_interval must be an integer >= 0, got -1"),
        ({"swap_state_replica_interval": 2.0}, "optimizer.swap_state_replica_interval must be an integer >= 0, got 2.0"),
        ({"swap_optimizer_backend": "remote", "swap_state_replica_interval": 2},
         "optimizer.swap_state_replica_interval needs optimizer.swap_state_checkpoint = 'snapshot'"),
        ({"swap_state_checkpoint": "snapshot", "swap_state_replica_interval": 2},
         "set optimizer.swap_optimizer_backend = 'remote'"),  # local backend
    ],
)
def test_settings_are_checked_naming_the_field(values, message):
    with pytest.raises(ValueError) as info:
        SwapSettings.of(type("Config", (), values)())
    assert message in str(info.value)


def test_the_replica_interval_reaches_the_container_config():
    from swap_state.client.remote.config import RemoteConfig
    from swap_state.client.torchtitan import settings as settings_module

    built = {}

    class Container:
        def __init__(self, *args, config: RemoteConfig, **kwargs):
            built["config"] = config

    settings = SwapSettings(swap_optimizer_backend="remote", swap_state_checkpoint="snapshot",
                            swap_state_replica_interval=2, swap_state_job_id="j")
    settings.check()
    import swap_state.client.remote.container as container_module
    original = container_module.RemoteSwapOptimizersContainer
    container_module.RemoteSwapOptimizersContainer = Container
    try:
        settings_module.build_swap_container([], object, {}, settings)
    finally:
        container_module.RemoteSwapOptimizersContainer = original
    assert built["config"].replica_interval == 2
