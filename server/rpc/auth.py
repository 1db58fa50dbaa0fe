"""Caller authentication as a grpc.aio server interceptor: a bearer token or a uid proof
(:class:`~swap_state.server.tenants.Tenants`). An unknown caller fails UNAUTHENTICATED before its
request is deserialised; a known one's tenant is the servicer's :func:`caller`. The health service
is exempt so orchestrator probes work without the secret (it reveals only SERVING / NOT_SERVING).
"""

from __future__ import annotations

import contextvars
import logging
import pathlib
import stat
from collections.abc import Awaitable, Callable

import grpc

from swap_state.common.caller_proof import CALLER_METADATA_KEY
from swap_state.common.errors import StartupError, UnauthenticatedError
from swap_state.server.logs import log_event
from swap_state.server.rpc.statuses import reason_metadata, status_for
from swap_state.server.tenants import ANYONE, Tenant, Tenants, read_secret_file

__all__ = ["EXEMPT_PREFIXES", "CallerAuthInterceptor", "caller", "read_token_file"]

log = logging.getLogger(__name__)

_CALLER: contextvars.ContextVar[Tenant] = contextvars.ContextVar("swap_state_caller", default=ANYONE)


def caller() -> Tenant:
    """The tenant of the call being served (:data:`ANYONE` where callers are not told apart)."""
    return _CALLER.get()

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def read_token_file(path: pathlib.Path) -> str:
    """The token (surrounding whitespace stripped). Warns when others may read the file."""
    info, token = read_secret_file(path, "--token-file")
    token = token.strip()
    if not token or any(ch.isspace() for ch in token) or not token.isprintable():
        raise StartupError(f"--token-file {path}: expected one token without spaces")
    if info.st_mode & stat.S_IROTH:
        log_event(log, "token_file_world_readable", logging.WARNING, path=path, hint=f"chmod o-r {path}")
    return token


class CallerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses an unknown caller; runs a known one's call with its tenant as :func:`caller`."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants
        self.denied = 0

    async def intercept_service(self,
                                continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        tenant = self._tenants.tenant_of(handler_call_details.invocation_metadata)
        if tenant is None:
            self.denied += 1
            log_event(log, "unauthenticated", logging.WARNING, method=method, denied_total=self.denied)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let grpc answer UNIMPLEMENTED as usual
            return None
        return _as_caller(handler, tenant) if tenant is not None else _deny(handler, self._tenants.proofs is not None)


def _as_caller(handler: grpc.RpcMethodHandler, tenant: Tenant) -> grpc.RpcMethodHandler:
    if handler.response_streaming:
        behaviour = handler.unary_stream or handler.stream_stream

        async def run(request, context):
            _CALLER.set(tenant)
            async for item in behaviour(request, context):
                yield item
    else:
        behaviour = handler.unary_unary or handler.stream_unary

        async def run(request, context):  # type: ignore[misc]
            _CALLER.set(tenant)
            return await behaviour(request, context)
    return handler._replace(**{_kind(handler): run})  # type: ignore[attr-defined]


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"


def _deny(handler: grpc.RpcMethodHandler, by_uid: bool) -> grpc.RpcMethodHandler:
    error = UnauthenticatedError(
        "this server tells callers apart by their uid, and the call names no proof file it owns "
        f"(metadata '{CALLER_METADATA_KEY}'): swap-state's client sends one; another client must "
        "create an empty file of a random 32-hex-digit name in <socket>.callers and name it"
        if by_uid else
        "missing or wrong token: send metadata 'authorization: Bearer <token>' with the "
        "contents of the server's --token-file (or your tenant's token of its --tenants)")
    code = status_for(error)

    async def deny_unary(request, context):
        await context.abort(code, str(error), trailing_metadata=reason_metadata(error))

    async def deny_stream(request, context):
        await deny_unary(request, context)
        yield  # pragma: no cover - makes this an async generator

    # No request deserializer: the body of an unauthenticated call is never parsed.
    make = getattr(grpc, f"{_kind(handler)}_rpc_method_handler")
    return make(deny_stream if handler.response_streaming else deny_unary)
