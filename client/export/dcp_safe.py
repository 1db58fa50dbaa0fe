"""Reading a DCP checkpoint without executing it: DCP's own reader unpickles ``.metadata`` with plain ``pickle`` and
non-tensor entries with ``torch.load(weights_only=False)``, so a planted checkpoint runs whatever it names. Here only
DCP's metadata classes and ``weights_only=True`` loads pass; anything else is refused, naming what the file asked for
(DCP has no such option)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["METADATA_GLOBALS", "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpoint"]

# The globals a DCP ``.metadata`` pickle may name (torch's dtypes besides: ``torch.<dtype>``).
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"})}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file names something that is not checkpoint data."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.path} asks to load {module}.{name}, which is no part of a DCP checkpoint's "
                               "metadata: refused (a checkpoint is data; this file may have been planted)")


class SafeFileSystemReader(FileSystemReader):
    """:class:`FileSystemReader` whose ``.metadata`` is unpickled with DCP's classes only.
    ``refused``: the refusal, kept here too (DCP wraps what its reader raises)."""

    refused: UnsafeCheckpoint | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as metadata_file:
                metadata = _MetadataUnpickler(metadata_file, str(path)).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        except UnsafeCheckpoint as exc:
            self.refused = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
    """Loads a whole checkpoint into a fresh dict (as ``dcp_to_torch_save`` does), the
    non-tensor entries with ``torch.load(weights_only=True)``. ``refused`` as the reader's."""

    refused: UnsafeCheckpoint | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            self.refused = UnsafeCheckpoint(
                f"entry {read_item.dest_index.fqn!r} of the checkpoint is not plain data (tensors, "
                f"numbers, strings, containers): refused ({str(exc).splitlines()[0].split('. ')[0]})")
            raise self.refused from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
