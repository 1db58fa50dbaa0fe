"""Each torchtitan line's entry point, imported under the other line, fails naming the switch
of the line that is installed; the settings both lines share keep one reading."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torchtitan", reason="torchtitan (the client extra) is not installed")

from swap_state.client.torchtitan.settings import SwapSettings  # noqa: E402
from swap_state.client.torchtitan.version import WrongTorchtitanLine, torchtitan_line  # noqa: E402


@pytest.mark.skipif(torchtitan_line() != "0.2", reason="checks the 0.2 venv (tests/adapter03 checks 0.3's)")
def test_the_0_3_override_under_0_2_names_the_custom_config_module():
    with pytest.raises(WrongTorchtitanLine, match="custom_config_module=swap_state.client.torchtitan_config"):
        import swap_state.client.torchtitan_override  # noqa: F401


def test_the_0_2_config_documents_every_shared_setting_with_the_same_default():
    from swap_state.client.torchtitan.config import Optimizer

    documented = {f.name: f.default for f in dataclasses.fields(Optimizer)}
    for field in dataclasses.fields(SwapSettings):
        assert documented[field.name] == field.default, field.name


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"swap_optimizer_backend": "gpu"}, "optimizer.swap_optimizer_backend must be one of 'local', 'remote', got 'gpu'"),
        ({"swap_state_checkpoint": "all"}, "optimizer.swap_state_checkpoint must be one of 'full', 'snapshot', got 'all'"),
        ({"swap_optimizer_times": True}, "optimizer.swap_optimizer_times must be an integer >= 1, got True"),
        ({"swap_state_checkpoint": "snapshot"}, "set optimizer.swap_optimizer_backend = 'remote'"),
    ],
)
def test_settings_are_checked_naming_the_field(values, message):
    with pytest.raises(ValueError) as info:
        SwapSettings.of(type("Config", (), values)())
    assert message in str(info.value)
