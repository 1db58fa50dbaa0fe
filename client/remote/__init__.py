"""The remote container: session and segment mapping, trainer header, snapshots, reattach
check, model area, checkpoint mode, the gRPC client and the embedded server."""
