"""A trainer's session whose KeepAlive stream fails says what to do next, by why it failed."""

from __future__ import annotations

import types

import grpc
import pytest

from swap_state.client.errors import SessionLostError
from swap_state.client.remote.rpc import RemoteSession
from swap_state.proto import swap_state_pb2 as pb


class _StreamError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Stream:
    def __init__(self, error: grpc.RpcError) -> None:
        self.error = error

    def __iter__(self):
        raise self.error

    def cancel(self) -> None:
        pass


def _lost(code: grpc.StatusCode, details: str) -> str:
    client = types.SimpleNamespace(
        config=types.SimpleNamespace(address="unix:///tmp/ss.sock"),
        open_keepalive=lambda session_id, generation: _Stream(_StreamError(code, details)),
    )
    session = RemoteSession(client, "demo", 0, 1, pb.AttachReply(session_id="s", generation=1))
    session._thread.join(5)
    with pytest.raises(SessionLostError) as err:
        session.check_alive()
    return str(err.value)


def test_a_session_the_server_freed_says_restore_or_a_longer_grace():
    why = "the server freed the state of job demo rank 0 40.0 s ago (...) (reason=grace_expired)"
    message = _lost(grpc.StatusCode.NOT_FOUND, why)
    assert f"NOT_FOUND: {why}" in message
    assert "restore a snapshot" in message and "a longer --grace" in message
    assert "after restarting the server" not in message  # the server did not go away


def test_another_failure_still_says_the_state_may_be_gone():
    message = _lost(grpc.StatusCode.UNAVAILABLE, "socket closed")
    assert "restore from a snapshot after restarting the server" in message
