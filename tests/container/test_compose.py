"""Issue 6's scenario against docker/compose.yaml on a real Docker engine.

The same steps as test_scenario.py (see scenario.py), on the images compose.yaml builds. Where
no engine is reachable, a private dockerd is started for these tests (tests/container/engine.py,
scripts/images.sh); the skip, where even that cannot be done, says exactly why.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from . import compose_run, scenario
from .compose_stack import ComposeStack
from .engine import EngineUnavailable, PrivateEngine, build_images, engine_unreachable

# The first test also waits for the engine and the images (about a minute and a half on CI's
# 2 cores, several where the wheels come from the network); each step then takes under a minute.
# The only file that uses the Docker engine: scripts/test.sh runs a file's tests on one xdist
# worker (--dist loadfile), so one engine (and its bridge networks) serves them all, in order.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1500)]

StackFactory = Callable[[str | None], ComposeStack]
# scripts/images.sh sets it: whoever asked for the images wants a failure, not a skip.
REQUIRE_ENV = "SWAP_STATE_REQUIRE_DOCKER"


def _say(config: pytest.Config, log: str) -> None:
    """The engine's and the builds' summary lines (what was installed, what each part took),
    shown in pytest's output even when it captures: CI's log should say them."""
    lines = [line for line in log.splitlines() if line.startswith(("images.sh:", "compose_run: built"))]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if not lines or reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


def _cannot_run(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def docker_engine(pytestconfig: pytest.Config) -> Iterator[None]:
    """The engine ``docker info`` reaches, else a private one started (and stopped) here."""
    if scenario.DEMO_MISSING:
        pytest.skip(scenario.DEMO_MISSING_REASON)
    unreachable = engine_unreachable()
    if unreachable is None:
        yield
        return
    try:
        engine = PrivateEngine.start()
    except EngineUnavailable as exc:
        _cannot_run(f"{unreachable}, and a private dockerd could not start: {exc}")
    _say(pytestconfig, engine.log)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in engine.env.items():
                patch.setenv(key, value)
            yield
    finally:
        _say(pytestconfig, engine.stop())


@pytest.fixture(scope="module")
def docker_images(docker_engine: None, pytestconfig: pytest.Config) -> None:
    _say(pytestconfig, build_images())


@pytest.fixture
def compose_stack(docker_images: None, tmp_path: Path) -> Iterator[StackFactory]:
    stacks: list[ComposeStack] = []

    def make(shm_size: str | None) -> ComposeStack:
        stack = ComposeStack(shm_size, tmp_path / f"stack-{len(stacks)}")
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()


def test_compose_up_as_documented(compose_stack: StackFactory) -> None:
    """What ``docker compose up --exit-code-from trainer`` runs: compose.yaml's own /dev/shm,
    --shm-size, healthcheck and trainer command (the override only binds the volumes, so that
    the report can be read): the demo trains to its last step, bitwise equal to torch AdamW."""
    server_command = [str(a) for a in compose_run.load()["services"]["server"]["command"]]
    stack = compose_stack(None)
    scenario.start_healthy_server(stack, server_command[server_command.index("--shm-size") + 1])
    trainer = stack.start_trainer(None)
    scenario.assert_bitwise_equal(scenario.finish(stack, trainer), trainer)


def test_trainer_sigkill_then_reattach(compose_stack: StackFactory) -> None:
    scenario.trainer_sigkill_then_reattach(compose_stack(scenario.POD_SHM_SIZE))


def test_server_stop_then_restore(compose_stack: StackFactory) -> None:
    scenario.server_stop_then_restore(compose_stack(scenario.POD_SHM_SIZE))


def test_server_rolling_restart(compose_stack: StackFactory) -> None:
    scenario.server_rolling_restart(compose_stack(scenario.POD_SHM_SIZE))


def test_small_dev_shm_server_refuses(compose_stack: StackFactory) -> None:
    scenario.small_shm_server_refuses(compose_stack(scenario.SMALL_POD_SHM_SIZE))
