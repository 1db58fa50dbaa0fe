"""``python -m swap_state.server.healthcheck --listen URI``: exit 0 when the server is SERVING, 1 otherwise (message on
stderr). For Docker/compose healthchecks and Kubernetes exec probes; the gRPC health service needs no token.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swap_state.common.addresses import default_listen, parse_address
from swap_state.common.errors import ConfigError

__all__ = ["check", "main"]


def check(listen: str, *, timeout: float = 3.0, service: str = "",
          tls_ca: pathlib.Path | None = None) -> tuple[bool, str]:
    """(serving, what was seen) for the server at ``listen`` (unix:///path or tcp://host:port)."""
    address = parse_address(listen)
    target = address.bind_target()
    if address.scheme == "tcp" and tls_ca is not None:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_ca.read_bytes()))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{address.url}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address.url}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swap_state.server.healthcheck",
                                     description="Exit 0 when the swap-state-server at --listen reports SERVING.")
    parser.add_argument("--listen", default=default_listen(),
                        help=f"the server's --listen address (default {default_listen()})")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    parser.add_argument("--service", default="", help="health service name (default '': the whole server)")
    parser.add_argument("--tls-ca", type=pathlib.Path, default=None, help="PEM roots for a tcp:// server with TLS")
    args = parser.parse_args(argv)
    try:
        serving, seen = check(args.listen, timeout=args.timeout, service=args.service, tls_ca=args.tls_ca)
    except (ConfigError, OSError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    print(seen, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
