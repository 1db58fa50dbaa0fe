"""Issue 6's scenario against a real `docker compose` project, where a Docker engine is reachable.

The same steps as test_scenario.py (see scenario.py), on the images docker/compose.yaml builds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from . import scenario
from .compose_stack import ComposeStack, build_images, docker_unavailable

# Building the images (torch included) dominates; the scenario itself takes about a minute.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

StackFactory = Callable[[str], ComposeStack]


@pytest.fixture(scope="module")
def docker_images() -> None:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    if scenario.DEMO_MISSING:
        pytest.skip(scenario.DEMO_MISSING_REASON)
    build_images()


@pytest.fixture
def compose_stack(docker_images: None, tmp_path: Path) -> Iterator[StackFactory]:
    stacks: list[ComposeStack] = []

    def make(shm_size: str) -> ComposeStack:
        stack = ComposeStack(shm_size, tmp_path / f"stack-{len(stacks)}")
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()


def test_trainer_sigkill_then_reattach(compose_stack: StackFactory) -> None:
    scenario.trainer_sigkill_then_reattach(compose_stack(scenario.POD_SHM_SIZE))


def test_server_stop_then_restore(compose_stack: StackFactory) -> None:
    scenario.server_stop_then_restore(compose_stack(scenario.POD_SHM_SIZE))


def test_server_rolling_restart(compose_stack: StackFactory) -> None:
    scenario.server_rolling_restart(compose_stack(scenario.POD_SHM_SIZE))


def test_small_dev_shm_server_refuses(compose_stack: StackFactory) -> None:
    scenario.small_shm_server_refuses(compose_stack(scenario.SMALL_POD_SHM_SIZE))
