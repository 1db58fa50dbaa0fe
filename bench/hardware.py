"""The machine, and its ceilings measured in the same run: disk sequential write/read (with
fsync, and with O_DIRECT where the filesystem allows it), host memcpy, CRC-32.

Page cache: a buffered write is only durable after fsync, so the write bandwidth that counts
is (write + fsync). Reads of a file just written come from the page cache; the cold read
first drops that file's cached pages (posix_fadvise DONTNEED after fsync, no root needed)
and O_DIRECT bypasses the cache entirely. In a VM, the hypervisor may still cache below
the guest: the numbers are what this guest sees.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import shutil
import time

from bench.util import cpu_count, gbps, summarize

__all__ = ["cpu_model", "crc32_bandwidth", "disk_bandwidth", "drop_file_cache", "fresh_memory_bandwidth", "machine",
           "memcpy_bandwidth"]

BLOCK = 8 << 20


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mount_of(path: str) -> tuple[str, str, str]:
    """(device, mount point, fstype) of the filesystem holding ``path``."""
    path = os.path.realpath(path)
    best = ("?", "/", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return best


def _block_device(dev: str) -> dict[str, object]:
    name = os.path.basename(dev)
    sys_dir = f"/sys/class/block/{name}"
    info: dict[str, object] = {"device": dev}
    if not os.path.exists(sys_dir):
        return info
    parent = os.path.basename(os.path.dirname(os.path.realpath(sys_dir)))
    disk = parent if os.path.exists(f"/sys/block/{parent}") else name

    def read(rel: str) -> str | None:
        try:
            with open(f"/sys/block/{disk}/{rel}") as f:
                return f.read().strip()
        except OSError:
            return None

    info["disk"] = disk
    size = read("size")
    if size:
        info["size_bytes"] = int(size) * 512
    rotational = read("queue/rotational")
    if rotational is not None:
        info["rotational"] = rotational == "1"
    model = read("device/model") or read("device/name")
    if model:
        info["model"] = model
    if disk.startswith("vd"):
        info["bus"] = "virtio (virtual machine disk)"
    elif disk.startswith("nvme"):
        info["bus"] = "nvme"
    return info


def machine(work_dir: str) -> dict[str, object]:
    """What the numbers came from."""
    import torch

    dev, mnt, fstype = _mount_of(work_dir)
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    try:
        import torchtitan

        titan = getattr(torchtitan, "__version__", "?")
    except Exception:  # pragma: no cover
        titan = "not importable"
    try:
        from importlib.metadata import version

        swap_state_version = version("swap-state")
    except Exception:  # pragma: no cover
        swap_state_version = "?"
    return {
        "cpu_model": cpu_model(),
        "cpus_usable": cpu_count(),
        "cpus_online": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": _mem_total(),
        "disk": {"path": work_dir, "mount": mnt, "fstype": fstype, **_block_device(dev)},
        "dev_shm_bytes": shm.total if shm else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": titan,
        "swap_state": swap_state_version,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def drop_file_cache(path: str) -> None:
    """Evict ``path``'s clean pages from the page cache (best effort, no root needed)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def drop_tree_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            drop_file_cache(os.path.join(dirpath, name))


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # anonymous mappings are page aligned (O_DIRECT needs it)
    buf.write(os.urandom(1 << 16) * (nbytes // (1 << 16)))
    buf.seek(0)
    return buf


def _write_file(path: str, total: int, buf: mmap.mmap, direct: bool) -> tuple[float, float]:
    """(seconds for the writes, seconds for the fsync)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < total:
            n = min(len(view), total - done)
            done += os.write(fd, view[:n])
        t1 = time.perf_counter()
        os.fsync(fd)
        t2 = time.perf_counter()
    finally:
        view.release()
        os.close(fd)
    return t1 - t0, t2 - t1


def _read_file(path: str, buf: mmap.mmap, direct: bool) -> tuple[int, float]:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        total = 0
        while True:
            n = os.readv(fd, [view])
            if n <= 0:
                break
            total += n
        return total, time.perf_counter() - t0
    finally:
        view.release()
        os.close(fd)


def disk_bandwidth(directory: str, nbytes: int, reps: int = 3) -> dict[str, object]:
    """Sequential write (buffered + fsync; O_DIRECT + fsync) and read (cold: after
    fadvise DONTNEED; O_DIRECT; warm: page cache) of an ``nbytes`` file in ``directory``."""
    nbytes = max(BLOCK, nbytes // BLOCK * BLOCK)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "disk-probe.bin")
    buf = _aligned_buffer(BLOCK)
    samples: dict[str, list[float]] = {k: [] for k in (
        "write_fsync", "write_pagecache_only", "write_direct", "read_cold", "read_direct", "read_warm")}
    notes: list[str] = []
    direct_ok = hasattr(os, "O_DIRECT")
    try:
        for _ in range(reps):
            os.sync()
            w, s = _write_file(path, nbytes, buf, direct=False)
            samples["write_fsync"].append(gbps(nbytes, w + s))
            samples["write_pagecache_only"].append(gbps(nbytes, w))
            drop_file_cache(path)
            n, t = _read_file(path, buf, direct=False)
            samples["read_cold"].append(gbps(n, t))
            n, t = _read_file(path, buf, direct=False)
            samples["read_warm"].append(gbps(n, t))
            if direct_ok:
                try:
                    drop_file_cache(path)
                    n, t = _read_file(path, buf, direct=True)
                    samples["read_direct"].append(gbps(n, t))
                    w, s = _write_file(path, nbytes, buf, direct=True)
                    samples["write_direct"].append(gbps(nbytes, w + s))
                except OSError as e:
                    direct_ok = False
                    notes.append(f"O_DIRECT not supported here ({e.strerror})")
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    out: dict[str, object] = {"bytes": nbytes, "block_bytes": BLOCK, "reps": reps, "notes": notes}
    for key, values in samples.items():
        if values:
            out[key + "_gbps"] = summarize(values)
    return out


def write_read_once(path: str, nbytes: int) -> dict[str, float]:
    """The disk reference taken next to each checkpoint measurement, in GB/s, for ``nbytes``
    at ``path``: buffered write + fsync and cold read (fadvise DONTNEED), and where the
    filesystem allows it O_DIRECT write + fsync and O_DIRECT read (the disk's own limit:
    what swap-state's persist and restore are measured against)."""
    nbytes = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
    buf = _aligned_buffer(BLOCK)
    out: dict[str, float] = {}
    try:
        w, s = _write_file(path, nbytes, buf, direct=False)
        out["write_fsync"] = gbps(nbytes, w + s)
        drop_file_cache(path)
        n, t = _read_file(path, buf, direct=False)
        out["read_cold"] = gbps(n, t)
        if hasattr(os, "O_DIRECT"):
            try:
                w, s = _write_file(path, nbytes, buf, direct=True)
                out["write_direct"] = gbps(nbytes, w + s)
                n, t = _read_file(path, buf, direct=True)
                out["read_direct"] = gbps(n, t)
            except OSError:
                pass  # the filesystem refuses O_DIRECT: the buffered figures stand alone
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


def memcpy_bandwidth(nbytes: int, reps: int = 5) -> dict[str, object]:
    """Host memcpy GB/s: torch ``copy_`` (torch's threads) and one-thread ``memmove``
    (what the server's Python writer does per chunk). Bytes copied, not read + written."""
    import torch

    nbytes = max(1 << 20, nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.fill_(2)  # fault both in before timing
    torch_samples, memmove_samples = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch_samples.append(gbps(nbytes, time.perf_counter() - t0))
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        memmove_samples.append(gbps(nbytes, time.perf_counter() - t0))
    return {
        "bytes": nbytes,
        "torch_copy_gbps": summarize(torch_samples),
        "memmove_1thread_gbps": summarize(memmove_samples),
        "torch_threads": torch.get_num_threads(),
    }


def fresh_memory_bandwidth(nbytes: int, reps: int = 3) -> dict[str, object]:
    """GB/s at which the kernel hands out fresh anonymous memory (page faults and zeroing,
    ``MADV_POPULATE_WRITE``) and seconds to give it back (``munmap``): what an O_DIRECT
    restore pays for its staging memory on top of the disk's read (on a VM each first touch
    may also be the hypervisor's fault)."""
    from swap_state.server import _posix

    populate, release = [], []
    for _ in range(reps):
        memory = mmap.mmap(-1, nbytes)
        t0 = time.perf_counter()
        _posix.populate_write(_posix.buffer_address(memory), nbytes)
        t1 = time.perf_counter()
        memory.close()
        release.append(time.perf_counter() - t1)
        populate.append(gbps(nbytes, t1 - t0))
    return {"bytes": nbytes, "populate_gbps": summarize(populate), "munmap_s": summarize(release)}


def crc32_bandwidth(nbytes: int = 64 << 20, reps: int = 3) -> dict[str, object]:
    """GB/s of the crc32 the snapshot writer and restore use (``swap_state.common.checksum``:
    isal where installed, else zlib): the writer checksums every byte it persists, and restore
    verifies every byte before copying."""
    from swap_state.common.checksum import IMPLEMENTATION, crc32

    data = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    view = memoryview(data)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        crc32(view)
        samples.append(gbps(len(data), time.perf_counter() - t0))
    view.release()
    return {"bytes": len(data), "implementation": IMPLEMENTATION, "gbps": summarize(samples)}
