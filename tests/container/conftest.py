"""Fixtures for the container tests: the harness (skipped, naming the missing kernel feature,
where namespaces are forbidden) and pods that are always torn down."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .harness import HarnessUnavailable, HostSupport, Pod, probe
from .scenario import HarnessStack

MakePod = Callable[..., Pod]


@pytest.fixture(scope="session")
def host_support() -> HostSupport:
    try:
        return probe()
    except HarnessUnavailable as exc:
        pytest.skip(f"container harness unavailable: {exc}")


@pytest.fixture
def make_pod(host_support: HostSupport) -> Iterator[MakePod]:
    """``make_pod(shm_size)``: a pod torn down (containers killed, mounts gone) after the test."""
    pods: list[Pod] = []

    def make(shm_size: str = "64m") -> Pod:
        pod = Pod(shm_size, support=host_support)
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        pod.close()


@pytest.fixture
def pod(make_pod: MakePod) -> Pod:
    return make_pod()


@pytest.fixture
def harness_stack(make_pod: MakePod) -> Callable[[str], HarnessStack]:
    """``harness_stack(shm_size)``: the compose project's volumes in a fresh pod."""
    return lambda shm_size: HarnessStack(make_pod(shm_size))
