"""The one place where domain errors become gRPC status codes (:func:`rpc_boundary`): a
SwapStateError becomes its code and message, anything else INTERNAL with a reference id logged
with the traceback, so a bug in one request never crashes the server or leaves the caller hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from swap_state.common.errors import REASON_METADATA_KEY, SwapStateError
from swap_state.server.logs import log_event
from swap_state.server.observability.metrics import RpcCounters

__all__ = ["rpc_boundary", "status_for", "reason_metadata"]

log = logging.getLogger(__name__)

def status_for(exc: SwapStateError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.code]


def reason_metadata(exc: SwapStateError) -> tuple[tuple[str, str], ...]:
    return ((REASON_METADATA_KEY, exc.reason),)


F = TypeVar("F", bound=Callable[..., Any])


def rpc_boundary(method: F) -> F:
    """Decorate a servicer method ``(self, request, context)``; the servicer must have a
    ``counters: RpcCounters`` attribute."""
    name = method.__name__

    @contextlib.asynccontextmanager
    async def boundary(counters: RpcCounters, context: grpc.aio.ServicerContext):
        """Map what escapes the call to a status (abort() raises) and count the call."""
        started = time.perf_counter()
        try:
            yield
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):  # abort() raises AbortError
            counters.record(name, grpc.StatusCode.CANCELLED, time.perf_counter() - started)
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary
            refused = isinstance(exc, SwapStateError)
            status = status_for(exc) if refused else grpc.StatusCode.INTERNAL
            # Counted before the status leaves: a client that reads the metrics as soon as
            # its call has failed must find the call counted.
            counters.record(name, status, time.perf_counter() - started)
            if refused:
                log_event(log, "rpc_refused", logging.DEBUG, method=name, code=status.name, error=str(exc))
                await context.abort(status, str(exc), trailing_metadata=reason_metadata(exc))
            ref = secrets.token_hex(4)
            log_event(log, "rpc_internal_error", logging.ERROR, method=name, ref=ref,
                      error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal server error (ref {ref}; see the server log)")
            raise AssertionError("unreachable")  # abort() raises
        else:
            counters.record(name, grpc.StatusCode.OK, time.perf_counter() - started)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
            async with boundary(self.counters, context):
                async for item in method(self, request, context):
                    yield item

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
        async with boundary(self.counters, context):
            return await method(self, request, context)

    return unary_wrapper  # type: ignore[return-value]
