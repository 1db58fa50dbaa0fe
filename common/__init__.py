"""The contracts both rooms rely on, written once: segment layout and header words, the
trainer's side of copy-before-write, the snapshot format and metadata schema, a read-only
snapshot reader, the dtype table, the id and key grammar, sizes, addresses, the server's
configuration, and the domain errors with their machine-readable reasons.

Nothing here imports torch, grpc, ``swap_state.server`` or ``swap_state.client``
(import-linter checks it).
"""
