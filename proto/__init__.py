"""The swap-state protocol: gRPC messages (generated from ``swap_state.proto``) and the
shared-memory segment layout (:mod:`swap_state.common.segment`)."""
