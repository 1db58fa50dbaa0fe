"""Refusals reach the trainer as typed exceptions, by the reason the server sends, through a
real server process: callers retry on SnapshotBusyError only, never on a bare status code."""

from __future__ import annotations

import grpc
import pytest

from swap_state.client import errors
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPECS = [("state.w.exp_avg", "float32", [4, 4])]


@pytest.fixture
def client(server):
    client = SwapStateClient(ClientConfig(server.address, rpc_timeout_s=10.0))
    yield client
    client.close()


@pytest.fixture
def session(client):
    session = client.attach("typed-errors", 0, 1)
    yield session
    session.close()


def _raises(cls: type[errors.SwapStateError], call, *args):
    with pytest.raises(errors.SwapStateError) as info:
        call(*args)
    assert type(info.value) is cls, f"{type(info.value).__name__}: {info.value}"
    return info.value


def test_refusals_are_typed_by_reason(client, session):
    error = _raises(errors.NoSegmentError, session.commit, 1)
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_SEGMENT")
    session.allocate(SPECS)
    error = _raises(errors.LayoutMismatchError, session.allocate, [("other", "float32", [2])])
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    _raises(errors.SessionLiveError, client.attach, "typed-errors", 0, 1)
    session.commit(1)
    # Not the last committed step: a plain precondition, which nobody may retry as "busy".
    error = _raises(errors.FailedPreconditionError, session.snapshot, 7)
    assert error.reason == "FAILED_PRECONDITION" and not isinstance(error, errors.SnapshotBusyError)
    _raises(errors.SnapshotNotFoundError, session.restore, "typed-errors/step-99")
    _raises(errors.InvalidRequestError, session.restore, "no/such/form")
    _raises(errors.InvalidRequestError, client.attach, ".hidden", 0, 1)


def test_a_generation_never_issued_is_stale(session):
    session.allocate(SPECS)
    issued = session.generation
    session.generation = issued + 1
    try:
        error = _raises(errors.StaleGenerationError, session.commit, 1)
        assert "generation" in str(error)
    finally:
        session.generation = issued

