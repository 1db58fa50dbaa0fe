"""Adoption: a server starting on the shm directory of one that died or was stopped takes over the
segments it left, so their trainers lose nothing. Nothing there is trusted: a file is adopted only
when its name (this tag), owner, header (magic, version), descriptor (the checks of an Attach and an
Allocate), replanned layout, hash and size all agree, and the budget holds it; anything else is
left and reported (:class:`Refused`). Of two segments of one (job, rank) the newer is adopted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import re
import stat
from collections.abc import Callable, Iterator

from swap_state.common.segment import (
    FIXED_WORDS, LAYOUT_VERSION, MAGIC, TensorSpec, SegmentHeader, SegmentLayout, Word, layout_hash,
    layout_hash_word, plan_segment, segment_file_bytes)
from swap_state.common.segment_descriptor import MAX_DESCRIPTOR_BYTES, SegmentDescriptor
from swap_state.common.server_header import ServerHeader
from swap_state.server.logs import log_event
from swap_state.server.memory.arena import Arena, Segment
from swap_state.server.tenants import tenant_uid

__all__ = ["Adopted", "Refused", "Validate", "adopt_segments", "discard_segments"]

Validate = Callable[[SegmentDescriptor], list[TensorSpec]]
"""Checks a descriptor's values as an Attach and an Allocate are (raises naming what is
wrong); returns the checked tensor specs."""

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"([0-9a-f]{32})\.([0-9]{1,18})")


@dataclasses.dataclass(frozen=True)
class Adopted:
    """A segment this server took over, and the session it belongs to."""

    segment: Segment
    descriptor: SegmentDescriptor
    session_id: str
    generation: int  # the generation that owned it (``TRAINER_GENERATION``; at least 1)
    open_epoch: int  # the snapshot epoch the previous server left open (now closed), 0 when none


@dataclasses.dataclass(frozen=True)
class Refused:
    """A file with this server's prefix that was not adopted, and why (left where it is)."""

    path: str
    reason: str


class _NotAdoptable(Exception):
    pass


def adopt_segments(arena: Arena, validate: Validate) -> tuple[list[Adopted], list[Refused]]:
    """Adopt every segment of ``arena.prefix`` that passes the module docstring's checks (the
    runtime's, before it serves; each then ``registry.adopt``'d); the others, with the reason."""
    adopted: list[tuple[int, Adopted]] = []
    refused: list[Refused] = []
    for entry in sorted(_own_entries(arena), key=lambda e: e.name):
        try:
            adopted.append(_adopt_one(arena, entry.name, validate))
        except _NotAdoptable as e:
            refused.append(Refused(entry.path, str(e)))
        except (OSError, ValueError) as e:  # mapping it failed (memory, a file changed meanwhile)
            refused.append(Refused(entry.path, f"cannot map it: {e}"))
    return _newest_per_rank(arena, adopted), refused


def _own_entries(arena: Arena) -> list[os.DirEntry[str]]:
    return [entry for entry in os.scandir(arena.shm_dir) if entry.name.startswith(arena.prefix)]


def _newest_per_rank(arena: Arena, adopted: list[tuple[int, Adopted]]) -> list[Adopted]:
    """One segment per (job, rank): the highest seq; an older one was superseded and is freed."""
    newest: dict[tuple[str, int], Adopted] = {}
    for _, item in sorted(adopted, key=lambda pair: pair[0]):
        key = (item.descriptor.job_id, item.descriptor.rank)
        older, newest[key] = newest.get(key), item
        if older is not None:
            log_event(log, "segment_superseded", logging.WARNING, path=older.segment.path,
                      job_id=older.descriptor.job_id, rank=older.descriptor.rank, by=item.segment.path,
                      detail="an older segment of the same job and rank: freed")
            arena.free(older.segment)
    return list(newest.values())


def _adopt_one(arena: Arena, name: str, validate: Validate) -> tuple[int, Adopted]:
    match = _SESSION_ID.fullmatch(name[len(arena.prefix):])
    if match is None:
        raise _NotAdoptable("the name is not swap-state.<tag>.<session id>.<seq>")
    session_id, seq = match.group(1), int(match.group(2))
    with _open_own_file(arena.shm_dir / name) as (fd, size, owner):
        words = _read_words(fd, size)
        raw, descriptor, specs = _read_descriptor(fd, size, words, validate)
        if owner != os.geteuid() and not (os.geteuid() == 0 and owner == tenant_uid(descriptor.tenant)):
            raise _NotAdoptable(f"owned by uid {owner}, not this server's {os.geteuid()} nor its tenant's")
        layout = _check_layout(words, size, specs, descriptor)
        segment = arena.segment_object(name, layout, descriptor.layout_hash, len(raw))
        segment.buffer = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    segment.header = SegmentHeader(segment.buffer, layout.n_chunks, layout.cow_slots)
    segment.tenant = descriptor.tenant
    try:
        arena.adopt(segment, seq)
    except Exception as e:
        segment._unmap()
        raise _NotAdoptable(f"no room in this server's budget: {e}") from None
    header = ServerHeader(segment.header)
    open_epoch = header[Word.SNAP_EPOCH]
    if open_epoch:
        header.close_snapshot(layout.cow_slots)  # that snapshot died with its server
    return seq, Adopted(segment, descriptor, session_id, max(1, header[Word.TRAINER_GENERATION]), open_epoch)


@contextlib.contextmanager
def _open_own_file(path: os.PathLike) -> Iterator[tuple[int, int, int]]:
    """(fd, size, owner uid) of a regular file of this uid (to a root server, of any: the caller
    checks it is its tenant's), opened without following a link or blocking (a FIFO)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _NotAdoptable(f"cannot open it ({e.strerror}; a symbolic link?)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _NotAdoptable("not a regular file")
        if info.st_uid != os.geteuid() and os.geteuid() != 0:
            raise _NotAdoptable(f"owned by uid {info.st_uid}, not this server's {os.geteuid()}")
        yield fd, info.st_size, info.st_uid
    finally:
        os.close(fd)


def _read_words(fd: int, size: int) -> SegmentHeader:
    raw = os.pread(fd, FIXED_WORDS * 8, 0)
    if len(raw) < FIXED_WORDS * 8:
        raise _NotAdoptable(f"{size} bytes: too short for a segment header")
    words = SegmentHeader(bytearray(raw), 0, 0)
    if words[Word.MAGIC] != MAGIC:
        raise _NotAdoptable("no swap-state segment magic")
    if words[Word.VERSION] != LAYOUT_VERSION:
        raise _NotAdoptable(f"layout version {words[Word.VERSION]}, this server reads {LAYOUT_VERSION} (a server "
                            "of another release made it: restore a snapshot instead)")
    return words


def _read_descriptor(fd: int, size: int, words: SegmentHeader,
                     validate: Validate) -> tuple[bytes, SegmentDescriptor, list[TensorSpec]]:
    offset, length = words[Word.DESCRIPTOR_OFFSET], words[Word.DESCRIPTOR_BYTES]
    if not 0 < length <= MAX_DESCRIPTOR_BYTES or offset + length > size:
        raise _NotAdoptable(f"descriptor of {length} bytes at {offset} does not fit the file ({size} bytes)")
    raw = os.pread(fd, length, offset)
    try:
        descriptor = SegmentDescriptor.decode(raw)
        specs = validate(descriptor)
    except Exception as e:  # whatever a hostile descriptor makes the checks raise
        raise _NotAdoptable(f"descriptor refused: {e}") from None
    return raw, descriptor, specs


def _check_layout(words: SegmentHeader, size: int, specs: list[TensorSpec],
                  descriptor: SegmentDescriptor) -> SegmentLayout:
    digest = layout_hash(specs)
    if digest != descriptor.layout_hash or layout_hash_word(digest) != words[Word.LAYOUT_HASH]:
        raise _NotAdoptable("the layout hash does not match its tensors")
    try:
        layout = plan_segment(specs, words[Word.CHUNK_BYTES], words[Word.COW_SLOTS])
    except ValueError as e:
        raise _NotAdoptable(f"header words: {e}") from None
    planned = (layout.header_bytes, layout.n_chunks, layout.cow_slots, layout.cow_slots_offset, layout.size)
    stated = (words[Word.HEADER_BYTES], words[Word.N_CHUNKS], words[Word.COW_SLOTS],
              words[Word.COW_SLOTS_OFFSET], words[Word.DESCRIPTOR_OFFSET])
    if planned != stated or words[Word.N_TENSORS] != len(specs):
        raise _NotAdoptable(f"header words {stated} do not describe its tensors {planned}")
    expected = segment_file_bytes(layout, words[Word.DESCRIPTOR_BYTES])
    if size != expected:
        raise _NotAdoptable(f"{size} bytes, its header states {expected} (truncated?)")
    return layout


def discard_segments(arena: Arena) -> tuple[int, int]:
    """Unlink the segment files a previous server with this tag left (``--discard-segments``):
    regular files of this uid only; (files, bytes). Called once no live server uses the tag."""
    removed = removed_bytes = 0
    for entry in _own_entries(arena):
        info = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed += 1
            removed_bytes += info.st_blocks * 512
    return removed, removed_bytes
