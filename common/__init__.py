"""The contracts client and server both rely on, written once: segment layout and protocol, snapshot format, ids, sizes,
addresses, server configuration, domain errors. Imports no torch, grpc, server or client (import-linter checks it).
"""
