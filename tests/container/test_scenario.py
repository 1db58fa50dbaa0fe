"""Issue 6's scenario in the namespace harness: runs wherever the tests run (CI included)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from . import scenario
from .scenario import HarnessStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150), scenario.requires_demo]

StackFactory = Callable[[str], HarnessStack]


def test_trainer_sigkill_then_reattach(harness_stack: StackFactory) -> None:
    scenario.trainer_sigkill_then_reattach(harness_stack(scenario.POD_SHM_SIZE))


def test_server_stop_then_restore(harness_stack: StackFactory) -> None:
    scenario.server_stop_then_restore(harness_stack(scenario.POD_SHM_SIZE))


def test_server_rolling_restart(harness_stack: StackFactory) -> None:
    scenario.server_rolling_restart(harness_stack(scenario.POD_SHM_SIZE))


def test_small_dev_shm_server_refuses(harness_stack: StackFactory) -> None:
    scenario.small_shm_server_refuses(harness_stack(scenario.SMALL_POD_SHM_SIZE))
