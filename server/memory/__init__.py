"""Host memory: the shm arena (budget, segments, copy pool) and the sessions that own segments."""
