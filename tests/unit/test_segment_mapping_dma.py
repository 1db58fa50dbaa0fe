"""The segment's DMA registration (SegmentMapping.register_for_dma) on a CPU backend that plays
an accelerator: the whole mapping is registered, in chunks that never end inside a tensor, and
the copy slots' area is cut at slot boundaries rather than registered as one oversized chunk."""

from __future__ import annotations

import mmap
import types

import torch

from swap_state.client.device import DeviceBackend
from swap_state.client.host_register import PAGE_SIZE
from swap_state.client.remote.segment_mapping import SegmentMapping
from swap_state.common.segment import TensorLayout


class _RegisteringBackend(DeviceBackend):
    """A CPU backend that says it is an accelerator and records the chunks it registers."""

    def __init__(self, chunk_bytes: int) -> None:
        super().__init__("cpu", chunk_bytes=chunk_bytes)
        self.chunks: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    @property
    def is_accelerator(self) -> bool:
        return True

    def _register_chunk(self, ptr: int, nbytes: int) -> int:
        self.chunks.append((ptr, nbytes))
        return 0

    def _unregister_chunk(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def _mapping(tensors: list[tuple[int, int]], slots: int, chunk_bytes: int) -> SegmentMapping:
    """A SegmentMapping over an anonymous mapping: ``tensors`` as ``(offset, nbytes)``, then
    ``slots`` copy slots of ``chunk_bytes`` each (no server, no header)."""
    slots_offset = -(-max(o + n for o, n in tensors) // PAGE_SIZE) * PAGE_SIZE
    size = slots_offset + slots * chunk_bytes
    mapping = SegmentMapping.__new__(SegmentMapping)
    mapping._mm = mmap.mmap(-1, size)
    mapping._base = torch.frombuffer(mapping._mm, dtype=torch.uint8)
    mapping.info = types.SimpleNamespace(
        size=size, cow_slots=slots, cow_slots_offset=slots_offset, chunk_bytes=chunk_bytes
    )
    mapping.tensors = tuple(
        TensorLayout(f"t{i}", "uint8", (n,), o, n) for i, (o, n) in enumerate(tensors)
    )
    mapping._registered = None
    return mapping


def test_chunks_never_end_inside_a_tensor_and_the_slots_are_cut_at_their_boundaries() -> None:
    limit = 4 * PAGE_SIZE
    # Tensors packed at 512-byte alignment across page boundaries, one over the limit.
    tensors = [(PAGE_SIZE, 3 * PAGE_SIZE + 512), (4 * PAGE_SIZE + 1024, 6 * PAGE_SIZE), (10 * PAGE_SIZE + 1536, 700)]
    mapping = _mapping(tensors, slots=6, chunk_bytes=2 * PAGE_SIZE)
    backend = _RegisteringBackend(limit)
    mapping.register_for_dma(backend)
    mapping.register_for_dma(backend)  # once
    base = mapping.data_ptr
    chunks = [(ptr - base, n) for ptr, n in backend.chunks]
    assert chunks[0][0] == 0 and sum(n for _, n in chunks) == mapping.info.size  # the whole mapping
    assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))  # contiguous
    for end in (a + n for a, n in chunks[:-1]):
        assert not any(o < end < o + n for o, n in tensors), f"a chunk ends at {end} inside a tensor"
    slots_offset = mapping.info.cow_slots_offset
    in_slots = [(a, n) for a, n in chunks if a >= slots_offset]
    assert in_slots and all(n <= limit for _, n in in_slots)
    mapping._registered[0].unregister_host_memory(base)
    assert backend.unregistered == [ptr for ptr, _ in backend.chunks]
