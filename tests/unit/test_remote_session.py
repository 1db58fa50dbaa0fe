"""A trainer's session whose KeepAlive stream fails: a server that is gone (UNAVAILABLE, or a
stop's notice) is reconnected to while training goes on; a server that answers it does not
hold the session any more loses it, saying what to do next."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator

import grpc
import pytest

from swap_state.client.errors import SessionLostError
from swap_state.common.errors import SERVER_STOPPING_NOTICE
from swap_state.common.retry import wait_until
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


class _Live:
    """A stream that delivers one event (or a stop's notice), then waits for its cancel."""

    def __init__(self, notice: str = "") -> None:
        self.notice = notice
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[pb.KeepAliveEvent]:
        yield pb.KeepAliveEvent(server_time_ms=1)
        if self.notice:
            yield pb.KeepAliveEvent(server_time_ms=2, notice=self.notice)
            return
        self._cancelled.wait(10)
        raise _StreamError(grpc.StatusCode.CANCELLED, "cancelled")

    def cancel(self) -> None:
        self._cancelled.set()


def _session(streams: list) -> RemoteSession:
    """A session whose keep-alive opens ``streams`` in turn (the last one again and again)."""
    opened = iter(streams)
    last: list = [None]

    def open_keepalive(session_id, generation):
        last[0] = next(opened, last[0])
        return last[0] if not isinstance(last[0], grpc.RpcError) else _Stream(last[0])

    client = types.SimpleNamespace(
        address="unix:///tmp/ss.sock", config=types.SimpleNamespace(server_wait_s=0.0),
        open_keepalive=open_keepalive,
        call=lambda *args, **kwargs: None,
    )
    return RemoteSession(client, "demo", 0, 1, pb.AttachReply(session_id="s", generation=1))


def _lost(code: grpc.StatusCode, details: str) -> str:
    session = _session([_StreamError(code, details)])
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


def test_another_answer_still_says_the_state_may_be_gone():
    message = _lost(grpc.StatusCode.PERMISSION_DENIED, "no")
    assert "restore from a snapshot after restarting the server" in message


def test_a_server_that_is_gone_or_stopping_is_reconnected_to():
    gone = _StreamError(grpc.StatusCode.UNAVAILABLE, "socket closed")
    session = _session([_Live(SERVER_STOPPING_NOTICE), gone, gone, _Live()])
    try:
        assert wait_until(lambda: session.reconnects == 1, timeout_s=10)
        assert not session.server_gone()
        session.check_alive()  # not lost: the next server took the same session back
    finally:
        session.close()


def test_a_restarted_server_that_did_not_adopt_the_session_loses_it():
    session = _session([_StreamError(grpc.StatusCode.UNAVAILABLE, "socket closed"),
                        _StreamError(grpc.StatusCode.NOT_FOUND, "no session s")])
    session._thread.join(10)
    with pytest.raises(SessionLostError, match="did not adopt this session's segment") as err:
        session.check_alive()
    assert "--discard-segments" in str(err.value)
