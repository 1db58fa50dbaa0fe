"""CUDA section (only when a GPU is present): host<->device bandwidth from registered
shared memory vs ``pin_memory`` tensors vs pageable memory, and the pipelined step of the
three optimizers with the moments on the GPU (plain) or streamed from host memory (swap).

Nothing here runs without CUDA; :func:`skip_reason` says why it was skipped.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from bench.util import gbps, summarize

__all__ = ["copy_bandwidth", "shm_tensor", "skip_reason"]


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA (torch.cuda.is_available() is False on this machine)"
    return None


def _time_copy(dst: torch.Tensor, src: torch.Tensor, reps: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)  # warm up (first-touch, driver paths)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out.append(gbps(src.numel() * src.element_size(), start.elapsed_time(end) / 1e3))
    return out


@contextlib.contextmanager
def shm_tensor(nbytes: int, shm_dir: str = "/dev/shm") -> Iterator[torch.Tensor]:
    """A uint8 tensor over a fresh, committed /dev/shm mapping of ``nbytes`` (page-rounded),
    as the server's segments are; the file is unlinked at once, the mapping closed at exit."""
    nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    fd, path = tempfile.mkstemp(prefix="swap-state-probe-", dir=shm_dir)
    try:
        # Commit now: a /dev/shm too small fails here, not with SIGBUS in the middle of a copy.
        os.posix_fallocate(fd, 0, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    try:
        yield tensor
    finally:
        del tensor
        with contextlib.suppress(BufferError):  # a view still alive: freed with its last tensor
            region.close()



def copy_bandwidth(nbytes: int, reps: int = 5, shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """H2D and D2H GB/s for three kinds of host memory of ``nbytes``:
    a /dev/shm mapping registered with the project's ``register_host_memory``
    (cudaHostRegister, what the remote container does), ``pin_memory`` (cudaHostAlloc, what
    the in-process container uses) and plain pageable memory."""
    from swap_state.client.device import get_device_backend

    backend = get_device_backend()
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = max(mmap.PAGESIZE, nbytes // mmap.PAGESIZE * mmap.PAGESIZE)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results: dict[str, Any] = {"bytes": nbytes}

    with shm_tensor(nbytes, shm_dir) as shm:
        shm.fill_(1)
        registration = backend.register_host_memory(shm.data_ptr(), nbytes)
        try:
            results["registered_shm"] = {
                "h2d_gbps": summarize(_time_copy(gpu, shm, reps)),
                "d2h_gbps": summarize(_time_copy(shm, gpu, reps)),
            }
        finally:
            backend.unregister_host_memory(registration.ptr)

    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    results["pin_memory"] = {
        "h2d_gbps": summarize(_time_copy(gpu, pinned, reps)),
        "d2h_gbps": summarize(_time_copy(pinned, gpu, reps)),
    }
    del pinned
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    results["pageable"] = {
        "h2d_gbps": summarize(_time_copy(gpu, pageable, reps)),
        "d2h_gbps": summarize(_time_copy(pageable, gpu, reps)),
    }
    del pageable, gpu
    torch.cuda.empty_cache()
    return results
