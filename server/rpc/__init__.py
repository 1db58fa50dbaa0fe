"""The gRPC surface: thin servicers, request validation, status mapping, auth, listener."""

__all__: list[str] = []
