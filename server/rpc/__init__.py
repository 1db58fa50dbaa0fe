"""The gRPC surface: thin servicers, request validation, status mapping, auth, listener."""
