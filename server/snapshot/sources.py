"""The snapshot a restore reads, verified: :class:`Source`, one complete snapshot and the tier
(``--snapshot-dir`` or ``--snapshot-store``) it is read from, which checks every read.

A local rank file the plan takes whole is read once (*staged*, :mod:`.staged_read`) while this
thread checksums it; only when every checksum passed are the bytes copied into the segment.
Where ``mlock`` is refused the staged pages may be evicted, so every copied chunk is checked
again as it lands: a file that changed underneath fails the restore ("restore again").
"""

from __future__ import annotations

import dataclasses
import logging
import os

from swap_state.common.checksum import crc32
from swap_state.common.segment import SegmentLayout
from swap_state.common.snapshot_errors import SnapshotCorrupt, SnapshotError
from swap_state.common.snapshot_format import RankManifest, TensorRecord
from swap_state.common.snapshot_reader import RankFileVerifier, SnapshotInfo, SnapshotReader, SnapshotTier
from swap_state.server import _posix
from swap_state.server.logs import log_event
from swap_state.server.snapshot import staged_read
from swap_state.server.snapshot.staged_read import Staging, stage_file

__all__ = ["Source"]

log = logging.getLogger("swap_state.server.restore")

_COPY_BYTES = 8 << 20
"""Unit of the copy into the segment (and of its re-check when the pages are not pinned)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One complete snapshot and the tier it is read from."""

    tier: SnapshotTier
    info: SnapshotInfo

    @property
    def where(self) -> str:
        """``local`` or ``store``: what the restore reply and logs say."""
        return self.tier.where

    @property
    def whole_files(self) -> bool:
        """A directory: a rank's whole file can be staged (:meth:`copy_whole_file`)."""
        return isinstance(self.tier, SnapshotReader)

    def read_layout(self) -> bytes | None:
        return self.tier.read_layout(self.info)

    def read_manifest(self, rank: int) -> RankManifest:
        return self.tier.read_manifest(self.info, rank)  # SnapshotNotFound: the rank is elsewhere

    def check_data_header(self, manifest: RankManifest) -> None:
        self.tier.check_data_header(self.info, manifest)

    def read_tensor(self, manifest: RankManifest, tensor: TensorRecord) -> bytes:
        return self.tier.read_tensor(self.info, manifest, tensor)

    def copy_whole_file(self, manifest: RankManifest, view: memoryview, layout: SegmentLayout) -> bool:
        """Stage the rank's data file once, verify all of it, then copy its tensors to their
        places in ``view`` (``layout``'s, in the same order); whether the staged bytes were
        pinned (else each copy was checked again)."""
        verifier = RankFileVerifier(self.info, manifest)  # the reader's checks, fed from the staged pages
        path = verifier.path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SnapshotCorrupt(f"{path} is missing") from None
        except OSError as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            verifier.check_size(size)
            try:
                staged = stage_file(fd, size)
            except OSError as exc:
                raise SnapshotError(f"cannot map {path}: {exc}") from None
            try:
                _verify_staged(staged, verifier, size)
                if not staged.pinned:
                    log_event(log, "restore_unpinned", logging.WARNING, path=path, bytes=size,
                              errno=staged.pin_errno,
                              detail="mlock refused (RLIMIT_MEMLOCK?): the staged pages may be evicted; "
                              "every copied chunk is checked again")
                _copy_staged(staged, manifest, view, layout, path)  # verified: only now the segment changes
                return staged.pinned
            finally:
                staged.close()
        except OSError as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None
        finally:
            os.close(fd)


def _verify_staged(staged: Staging, verifier: RankFileVerifier, size: int) -> None:
    """Checksum each region as soon as the reader has it in memory."""
    header_end = len(verifier.header)
    staged.wait(header_end)
    verifier.check_header(staged.view[:header_end])
    position, region = header_end, staged_read.STAGE_REGION_BYTES
    while position < size:
        upto = min(size, (position // region + 1) * region)
        staged.wait(upto)
        verifier.feed(staged.view[position:upto])
        position = upto
    verifier.finish()


def _copy_staged(staged: Staging, manifest: RankManifest, view: memoryview, layout: SegmentLayout,
                 path: os.PathLike[str]) -> None:
    """Every (verified) tensor from the staged mapping into its place in the segment; the
    copies re-checked when the pages were not pinned."""
    base = _posix.buffer_address(view)
    for tensor, target in zip(manifest.tensors, layout.tensors):
        source = manifest.data_start + tensor.data_offsets[0]
        value = 0
        for done in range(0, target.nbytes, _COPY_BYTES):
            n = min(_COPY_BYTES, target.nbytes - done)
            _posix.memmove(base + target.offset + done, staged.address + source + done, n)
            if not staged.pinned:
                with view[target.offset + done : target.offset + done + n] as landed:
                    value = crc32(landed, value)
        if not staged.pinned and value != tensor.crc32:
            raise SnapshotCorrupt(f"{path} changed while being restored (tensor {tensor.name!r} no longer "
                                  "matches its checksum); the segment is partially overwritten: restore "
                                  "again")
