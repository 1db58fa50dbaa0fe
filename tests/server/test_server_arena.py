"""The arena without gRPC: budget, segment files, pre-faulting, mlock, leftovers, borrowing."""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat

import grpc
import pytest
from swap_server_testkit import Trainer, descriptor, spec

from swap_state.common.segment import MAGIC, PAGE_BYTES, SegmentHeader, Word
from swap_state.server.memory import arena as arena_mod
from swap_state.server.memory import shm_dir as shm_dir_mod
from swap_state.server.memory.adopt import discard_segments
from swap_state.server.memory.arena import Arena
from swap_state.server.memory.shm_dir import check_shm_dir
from swap_state.common.errors import BudgetExhaustedError, StartupError, ServerUnavailableError

CHUNK = 64 << 10
SPECS = [("a", "float32", (3000,)), ("b", "bfloat16", (10, 10)), ("c", "uint8", (0,))]


def make_arena(shm_dir, total=16 << 20, cow=4 * CHUNK, **kw) -> Arena:
    return Arena(shm_dir=shm_dir, total_bytes=total, cow_pool_bytes=cow, chunk_bytes=CHUNK,
                 tag="t3st", **kw)


def test_segment_file_layout_header_and_accounting(shm_dir):
    arena = make_arena(shm_dir)
    seg = arena.create_segment("abc123", descriptor(SPECS, 1))
    try:
        assert seg.path.parent == shm_dir and seg.path.name.startswith("swap-state.t3st.abc123.")
        info = os.stat(seg.path)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == seg.file_bytes
        assert info.st_blocks * 512 >= seg.file_bytes  # every page committed
        assert all(t.offset % PAGE_BYTES == 0 for t in seg.layout.tensors)
        assert seg.header[Word.MAGIC] == MAGIC
        # The largest tensor (12000 bytes) is smaller than --chunk-bytes: page-aligned chunks.
        assert seg.header[Word.CHUNK_BYTES] == seg.layout.chunk_bytes == 3 * PAGE_BYTES
        # Another mapping of the file sees the server's header.
        with open(seg.path, "rb") as f:
            assert int.from_bytes(f.read(8), "little") == MAGIC
        assert arena.used_bytes == seg.file_bytes  # the layout, then its descriptor
        assert arena.free_bytes == (16 << 20) - 4 * CHUNK - seg.layout.cow_slots_offset - (seg.file_bytes - seg.size)
        assert arena.cow_slots_used == seg.cow_slots == seg.layout.n_chunks == 2  # no more than chunks
    finally:
        arena.free(seg)
    assert not seg.path.exists() and arena.used_bytes == 0 and arena.segments == []


def test_small_segments_get_small_chunks_and_slots_large_ones_chunk_bytes(shm_dir):
    arena = make_arena(shm_dir)
    small = arena.create_segment("small1", descriptor([("x", "float32", (10,))], 1))
    big = arena.create_segment("big1", descriptor([("y", "float32", (3 * CHUNK // 4,))], 1))
    try:
        assert small.layout.chunk_bytes == PAGE_BYTES and small.cow_slots == 1
        assert big.layout.chunk_bytes == CHUNK and big.cow_slots == 3
        assert arena.used_bytes == small.file_bytes + big.file_bytes  # exact: the files' bytes
        assert arena.cow_slots_used == 4  # each slot still counts as one slot of the pool
    finally:
        arena.free(small)
        arena.free(big)
    assert arena.used_bytes == 0 and arena.cow_slots_used == 0


def test_cow_share_splits_the_pool_between_local_ranks(shm_dir):
    arena = make_arena(shm_dir, cow=16 * CHUNK)
    assert arena.cow_share(1) == 16
    assert arena.cow_share(8) == 2
    assert arena.cow_share(64) == 2  # a host holds at most ~8 ranks of a big job
    assert make_arena(shm_dir, cow=0).cow_share(1) == 0


def test_group_makes_segments_0660(shm_dir):
    arena = make_arena(shm_dir, gid=os.getgid())
    seg = arena.create_segment("g1", descriptor(SPECS, 1))
    assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o660
    assert os.stat(seg.path).st_gid == os.getgid()
    arena.free(seg)


def test_full_tmpfs_fails_the_allocation_not_a_later_page_fault(shm_dir, monkeypatch):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arena_mod.os, "posix_fallocate", enospc)
    arena = make_arena(shm_dir)
    with pytest.raises(BudgetExhaustedError) as err:
        arena.create_segment("full1", descriptor(SPECS, 1))
    message = str(err.value)
    assert "docker run --shm-size" in message and "shm_size" in message
    assert "requested" in message and "free" in message and "total" in message
    assert arena.used_bytes == 0 and os.listdir(shm_dir) == []
    assert arena.allocation_failures == 1


async def test_full_tmpfs_is_resource_exhausted_over_grpc(server, stub, monkeypatch, shm_dir):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arena_mod.os, "posix_fallocate", enospc)
    trainer = Trainer(stub)
    await trainer.attach()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await trainer.allocate([spec("m", (100,))])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.arena.used_bytes == 0 and os.listdir(shm_dir) == []


def test_fallocate_unsupported_falls_back_to_writing_pages(shm_dir, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(arena_mod.os, "posix_fallocate", unsupported)
    arena = make_arena(shm_dir)
    seg = arena.create_segment("nofa", descriptor(SPECS, 1))
    assert os.stat(seg.path).st_blocks * 512 >= seg.size
    arena.free(seg)


@pytest.mark.parametrize("no_mlock2", [False, True], ids=["mlock2-refused", "no-mlock2-mlock-refused"])
def test_mlock_refusal_warns_once_naming_the_fix(shm_dir, monkeypatch, caplog, no_mlock2):
    monkeypatch.setattr(arena_mod, "_mlock_on_fault", lambda address, length: errno.ENOSYS if no_mlock2 else errno.EPERM)
    monkeypatch.setattr(arena_mod, "_mlock", lambda address, length: errno.EPERM)
    caplog.set_level(logging.DEBUG, logger="swap_state")
    arena = make_arena(shm_dir)
    first = arena.create_segment("ml1", descriptor(SPECS, 1))
    second = arena.create_segment("ml2", descriptor(SPECS, 1))
    assert not first.locked and not second.locked and arena.mlock_failures == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.msg == "mlock_refused"]
    assert len(warnings) == 1
    hint = warnings[0].swap_state_fields["hint"]
    assert "RLIMIT_MEMLOCK" in hint and "CAP_IPC_LOCK" in hint
    arena.free(first)
    arena.free(second)


def _proc_status(field: str) -> str:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return line.split()[1]
    raise AssertionError(f"no {field} in /proc/self/status")


def _locked_kib() -> int:
    return int(_proc_status("VmLck"))


@pytest.mark.parametrize("no_mlock2", [False, True], ids=["mlock2-on-fault", "no-mlock2-mlock-after"])
def test_mlock_locks_the_pages_when_allowed(shm_dir, monkeypatch, no_mlock2):
    if no_mlock2:
        monkeypatch.setattr(arena_mod, "_mlock_on_fault", lambda address, length: errno.ENOSYS)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    arena = make_arena(shm_dir)
    before = _locked_kib()
    seg = arena.create_segment("ml3", descriptor(SPECS, 1))
    cap_ipc_lock = bool(int(_proc_status("CapEff"), 16) & (1 << 14))
    allowed = cap_ipc_lock or soft == resource.RLIM_INFINITY or soft >= seg.size + (before << 10)
    if allowed:
        assert seg.locked and arena.mlock_failures == 0
        assert _locked_kib() - before >= seg.size >> 10
    else:
        assert not seg.locked and arena.mlock_failures == 1
    arena.free(seg)
    assert _locked_kib() == before  # unmapping unlocks


def test_free_waits_for_borrowers(shm_dir):
    arena = make_arena(shm_dir)
    seg = arena.create_segment("br1", descriptor(SPECS, 1))
    with seg.borrow() as buffer:
        arena.free(seg)
        assert seg.freed and seg.path.exists()  # still being read: not gone yet
        assert buffer[:8] == MAGIC.to_bytes(8, "little")
        with pytest.raises(ServerUnavailableError):
            with seg.borrow():
                pass
    assert not seg.path.exists() and arena.used_bytes == 0 and seg.buffer is None


def test_close_frees_everything_and_refuses_more(shm_dir):
    arena = make_arena(shm_dir)
    arena.create_segment("c1", descriptor(SPECS, 1))
    arena.create_segment("c2", descriptor(SPECS, 1))
    arena.close()
    assert os.listdir(shm_dir) == [] and arena.used_bytes == 0
    with pytest.raises(ServerUnavailableError):
        arena.create_segment("c3", descriptor(SPECS, 1))


def test_leftovers_of_the_same_tag_only_are_removed(shm_dir):
    (shm_dir / "swap-state.t3st.dead.1").write_bytes(b"x" * 4096)
    (shm_dir / "swap-state.other.dead.1").write_bytes(b"x")
    (shm_dir / "unrelated").write_bytes(b"x")
    os.symlink("/etc/passwd", shm_dir / "swap-state.t3st.link")
    files, nbytes = discard_segments(make_arena(shm_dir))
    assert files == 1 and nbytes >= 4096
    assert sorted(os.listdir(shm_dir)) == ["swap-state.other.dead.1", "swap-state.t3st.link", "unrelated"]


def test_shm_dir_check(shm_dir, tmp_path):
    assert check_shm_dir(shm_dir, 1 << 20) >= 1 << 20
    with pytest.raises(StartupError) as err:
        check_shm_dir(shm_dir, 100 << 40)
    assert "docker run --shm-size 102400g" in str(err.value) and "shm_size" in str(err.value)
    with pytest.raises(StartupError):
        check_shm_dir(shm_dir / "missing", 1)
    if shm_dir_mod.filesystem_type(tmp_path) not in shm_dir_mod.MEMORY_FILESYSTEMS:
        with pytest.raises(StartupError) as err:
            check_shm_dir(tmp_path, 1)
        assert "not tmpfs" in str(err.value)


def test_header_reads_back_through_segment_header(shm_dir):
    arena = make_arena(shm_dir)
    seg = arena.create_segment("hd1", descriptor(SPECS, 1))
    with open(seg.path, "r+b") as f:
        import mmap

        mapping = mmap.mmap(f.fileno(), seg.size)
        header = SegmentHeader(mapping)
        header.check()
        assert header.n_chunks == seg.layout.n_chunks and header.cow_slots == seg.cow_slots
        header.release()
        mapping.close()
    arena.free(seg)
