"""Host memory: the shm arena (budget, copy pool) with its segment files and the shm-directory
checks, and the sessions (registry and types) that own segments."""

__all__: list[str] = []
