"""The remote container: its segment, snapshots, model area, gRPC client and embedded server."""
