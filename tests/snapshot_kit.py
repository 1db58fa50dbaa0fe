"""The snapshot test kit, one for every snapshot test.

- Domain level (no gRPC, no server process): :class:`Segment`, a real mapped segment in a
  temp file, built exactly as the server builds one (``plan_segment`` +
  ``SegmentHeader.initialize`` on a zero-filled mapped file), and :class:`Trainer`, a thread
  that plays the trainer through the copy-before-write protocol.
- Files: :func:`flip_byte`, :func:`flip_byte_of_tensor`, :func:`data_file`,
  :func:`rank_manifest`, :func:`tiny_tmpfs` (a full disk on demand), and the ``swap-state``
  command line.
- Integration level (a real server process, torch): :class:`WideNet`, whose moments span
  several chunks, the torch reference, and step-N records of a container's host cache. The
  training loop is :mod:`integration.workload`'s.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pathlib
import random
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
from integration.workload import Workload, kwargs, train

from swap_state.common.checksum import crc32
from swap_state.common.copy_before_write import TrainerProtector
from swap_state.common.segment import PAGE_BYTES, SegmentHeader, Word, chunk_table, plan_segment
from swap_state.common.server_header import ServerHeader
from swap_state.common.snapshot_metadata import parse_metadata
from swap_state.common.snapshot_metadata_parts import MetadataParts, encode_base, encode_delta, parse_base, parse_delta
from swap_state.common.snapshot_reader import SnapshotReader
from swap_state.common.snapshot_tier import SnapshotInfo
from swap_state.server.snapshot.coordinator import SnapshotSource

__all__ = [
    "SPECS",
    "Segment",
    "Trainer",
    "metadata_for",
    "flip_byte",
    "CHUNK",
    "SWAP_STATE_CLI",
    "WideNet",
    "build_wide",
    "moment_bytes",
    "reference",
    "record_state",
    "params_copy",
    "bitwise_diff",
    "data_file",
    "rank_manifest",
    "verify_rank_file",
    "flip_byte_of_tensor",
    "tiny_tmpfs",
    "swap_state_cli",
]

# Mixed dtypes, a tensor that is not a multiple of the chunk size, and an empty one.
SPECS: list[tuple[str, str, tuple[int, ...]]] = [
    ("layers.0.w.exp_avg", "float32", (32, 256)),
    ("layers.0.w.exp_avg_sq", "float32", (32, 256)),
    ("layers.0.b.exp_avg", "bfloat16", (50, 100)),
    ("layers.0.b.exp_avg_sq", "bfloat16", (50, 100)),
    ("emb.exp_avg", "uint8", (5000,)),
    ("empty.exp_avg", "float32", (0, 16)),
]


class Segment:
    """A mapped segment file with an initialized header."""

    def __init__(
        self,
        path: pathlib.Path,
        specs=SPECS,
        *,
        chunk_bytes: int = PAGE_BYTES,
        cow_slots: int = 4,
        attach: bool = False,
    ):
        """``attach``: map an existing segment file (another process made it) as it is."""
        self.path = path
        self.specs = list(specs)
        self.layout = plan_segment(self.specs, chunk_bytes, cow_slots)
        if not attach:
            with open(path, "wb") as f:
                f.truncate(self.layout.size)
        self._file = open(path, "r+b")
        self.mm = mmap.mmap(self._file.fileno(), self.layout.size)
        self.header = SegmentHeader(self.mm, self.layout.n_chunks, self.layout.cow_slots)
        if not attach:
            ServerHeader(self.header).initialize(self.layout)
        self.chunks = chunk_table(self.layout.tensors, self.layout.chunk_bytes)

    def fill(self, seed: int) -> dict[str, bytes]:
        """Random contents for every tensor; returns them by name."""
        rng = random.Random(seed)
        for tensor in self.layout.tensors:
            self.mm[tensor.offset : tensor.offset + tensor.nbytes] = rng.randbytes(tensor.nbytes)
        return self.tensors()

    def tensors(self) -> dict[str, bytes]:
        return {t.name: bytes(self.mm[t.offset : t.offset + t.nbytes]) for t in self.layout.tensors}

    def tensor_area(self) -> bytes:
        """Everything between the header and the copy slots (tensors and padding)."""
        return bytes(self.mm[self.layout.header_bytes : self.layout.cow_slots_offset])

    def source(
        self, job_id: str, step: int, *, rank: int = 0, world_size: int = 1, metadata_json: str = "",
        local_world_size: int = 0, keep_latest: int = 0, keep_all: bool = False,
        replace_existing: bool = False, session_id: str = "", generation: int = 0,
    ) -> SnapshotSource:
        return SnapshotSource(
            buffer=self.mm,
            layout=self.layout,
            header=self.header,
            job_id=job_id,
            rank=rank,
            world_size=world_size,
            step=step,
            metadata_parts=metadata_parts(metadata_json, self.layout.tensors),
            keep_latest=keep_latest,
            keep_all=keep_all,
            replace_existing=replace_existing,
            local_world_size=local_world_size,
            session_id=session_id,
            generation=generation,
        )

    def slots_all_free(self) -> bool:
        return all(
            self.header.slot_taken(j) == self.header.slot_freed(j) for j in range(self.layout.cow_slots)
        )

    def close(self) -> None:
        self.header.release()
        self.mm.close()
        self._file.close()


def metadata_parts(metadata_json: str, tensors) -> MetadataParts | None:
    """A trainer's metadata, written whole for readability here, as the base and delta a
    snapshot carries (validated on the way, as the server validates them)."""
    if not metadata_json:
        return None
    whole = parse_metadata(metadata_json, tensors)
    fqns = list(dict.fromkeys([*whole.param_groups, *whole.steps]))
    groups: list[dict] = []
    for fqn in fqns:
        if whole.param_groups.get(fqn, {}) not in groups:
            groups.append(whole.param_groups.get(fqn, {}))
    indices = [groups.index(whole.param_groups.get(fqn, {})) for fqn in fqns]
    base = parse_base(encode_base(whole.tensors, whole.model_aliases, fqns, indices), tensors)
    return parse_delta(encode_delta(groups, [whole.steps.get(fqn, 0) for fqn in fqns]), base)


def metadata_for(segment: Segment, *, step: int = 7, global_shapes: dict | None = None) -> str:
    """Trainer metadata in the documented schema: fqn/key from ``<fqn>.<key>`` names."""
    tensors = {}
    fqns = []
    for name, _, _ in segment.specs:
        fqn, _, key = name.rpartition(".")
        entry = {"fqn": fqn, "key": key}
        if global_shapes and name in global_shapes:
            entry["global_shape"], entry["global_offset"] = global_shapes[name]
        tensors[name] = entry
        if fqn not in fqns:
            fqns.append(fqn)
    groups = {
        fqn: {
            "lr": 0.001,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "foreach": None,
            "step": {"__tensor__": float(step), "dtype": "float32"},
        }
        for fqn in fqns
    }
    return json.dumps({"tensors": tensors, "param_groups": groups, "steps": {f: step for f in fqns}})


class Trainer(threading.Thread):
    """Plays the trainer side of the protocol: ``n_steps`` steps after ``first_step``, each
    overwriting every chunk (in update order) after ``TrainerProtector.before_write``."""

    def __init__(self, segment: Segment, first_step: int, n_steps: int, *, max_wait_s: float = 30.0,
                 before_step=None, server_gone=None):
        """``before_step(step)``: called before each step's writes (e.g. a forward/backward's
        worth of sleep); ``server_gone()``: whether the server is unreachable (protocol step 6)."""
        super().__init__(daemon=True)
        self.segment = segment
        self.first_step = first_step
        self.n_steps = n_steps
        self.max_wait_s = max_wait_s
        self.before_step = before_step
        self.server_gone = server_gone
        self.error: BaseException | None = None
        self.copies = 0
        self.steps_done = 0

    @staticmethod
    def pattern(step: int, chunk_index: int, nbytes: int) -> bytes:
        return bytes([(step * 7 + chunk_index * 13 + 1) % 256]) * nbytes

    def run(self) -> None:
        seg = self.segment
        protector = TrainerProtector(seg.mm, seg.layout, header=seg.header, max_wait_s=self.max_wait_s,
                                     server_gone=self.server_gone)
        try:
            for step in range(self.first_step, self.first_step + self.n_steps):
                if self.before_step is not None:
                    self.before_step(step)
                seg.header[Word.WRITING_STEP] = step + 1
                for chunk in seg.chunks:
                    self.copies += protector.before_write(chunk.offset, chunk.nbytes)
                    seg.mm[chunk.offset : chunk.offset + chunk.nbytes] = self.pattern(
                        step, chunk.index, chunk.nbytes
                    )
                seg.header[Word.WRITING_STEP] = 0
                self.steps_done += 1
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            protector.close()

    def expected_final(self) -> dict[str, bytes]:
        """Every tensor's bytes after the last step, built from the patterns alone."""
        last = self.first_step + self.n_steps - 1
        parts: dict[str, list[bytes]] = {t.name: [] for t in self.segment.layout.tensors}
        for chunk in self.segment.chunks:
            name = self.segment.layout.tensors[chunk.tensor_index].name
            parts[name].append(self.pattern(last, chunk.index, chunk.nbytes))
        return {name: b"".join(p) for name, p in parts.items()}


def flip_byte(path: os.PathLike[str], offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x5A]))


#: Chunk size the servers of these tests use: a multiple of the page size, far below the
#: default, so one moment tensor of :class:`WideNet` is several chunks.
CHUNK = 64 << 10
#: The ``swap-state`` command (pyproject's [project.scripts] points it at this module's main;
#: run through the interpreter so a stale console-script shim cannot stand in for it).
SWAP_STATE_CLI = (sys.executable, "-m", "swap_state.client.cli")


class WideNet(nn.Module):
    """Same input as :class:`.workload.Net` (so :func:`.workload.train` drives it); its middle
    weight is 256 KiB, i.e. 4 chunks of :data:`CHUNK` per moment."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 256)
        self.mid = nn.Linear(256, 256)
        self.head = nn.Linear(256, 6)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.body(x)))))


def build_wide(w: Workload) -> WideNet:
    torch.manual_seed(w.seed)
    return WideNet()


def moment_bytes(model: nn.Module) -> int:
    """Bytes of exp_avg + exp_avg_sq of every parameter."""
    return sum(2 * p.numel() * p.element_size() for p in model.parameters())


def reference(w: Workload, builder, steps: int):
    """An uninterrupted torch fused AdamW run of ``steps`` steps: (model, optimizer)."""
    model = builder(w)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **kwargs(w))
    train(model, optimizer, w, range(1, steps + 1))
    return model, optimizer


def record_state(model: nn.Module, container) -> dict[str, torch.Tensor]:
    """Copies of the host cache now, under the segment's tensor names (``state.<fqn>.<key>``),
    plus the per-parameter steps in update order (``swap_state.param_steps``)."""
    out: dict[str, torch.Tensor] = {}
    steps = []
    for name, param in model.named_parameters():
        host = container.param_to_cpu_states_map[param]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if host.get(key) is not None:
                out[f"state.{name}.{key}"] = host[key].clone()
        steps.append(float(host["step"]))
    out["swap_state.param_steps"] = torch.tensor(steps, dtype=torch.float32)
    return out


def params_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def bitwise_diff(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Keys of ``expected`` missing from ``actual`` or not bitwise equal there."""
    return [
        k
        for k, v in expected.items()
        if k not in actual
        or actual[k].dtype != v.dtype
        or actual[k].shape != v.shape
        or not torch.equal(actual[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    ]


def data_file(status_path: str, rank: int = 0) -> pathlib.Path:
    return pathlib.Path(status_path) / f"rank-{rank:05d}.safetensors"


def rank_manifest(status_path: str, rank: int = 0) -> dict:
    return json.loads((pathlib.Path(status_path) / f"rank-{rank:05d}.manifest.json").read_text())


def verify_rank_file(reader: SnapshotReader, info: SnapshotInfo, rank: int = 0) -> None:
    """A rank's data file of a complete snapshot, checked as restore reads it (size, header,
    every tensor's crc32), and its whole crc32 as ``snapshot.json`` records it."""
    manifest = reader.read_manifest(info, rank)
    reader.check_data_header(info, manifest)
    for tensor in manifest.tensors:
        reader.read_tensor(info, manifest, tensor)
    assert crc32((info.path / manifest.data_file).read_bytes()) == info.file(manifest.data_file).crc32


def flip_byte_of_tensor(path: pathlib.Path, tensor: str, at: int = 5) -> None:
    """Flip one bit of byte ``at`` of ``tensor``'s data in a safetensors file, found through
    the file's own header (8-byte little-endian length, JSON, then the data)."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    begin, end = header[tensor]["data_offsets"]
    assert at < end - begin
    raw[8 + header_len + begin + at] ^= 0x10
    path.write_bytes(bytes(raw))


@contextlib.contextmanager
def tiny_tmpfs(path: pathlib.Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the block; skips when mount is refused."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def swap_state_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``swap-state ARGS`` in a process of its own."""
    return subprocess.run([*SWAP_STATE_CLI, *args], capture_output=True, text=True, timeout=timeout)
