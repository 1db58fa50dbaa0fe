"""The one dtype table: names in the segment and manifests, item sizes, safetensors codes."""

from __future__ import annotations

__all__ = ["DTYPE_ITEMSIZE", "SAFETENSORS_DTYPES", "DTYPE_NAMES"]

# name -> (item size in bytes, safetensors dtype code)
_TABLE: dict[str, tuple[int, str]] = {
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float64": (8, "F64"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "uint8": (1, "U8")}

DTYPE_NAMES: tuple[str, ...] = tuple(_TABLE)
DTYPE_ITEMSIZE: dict[str, int] = {name: size for name, (size, _) in _TABLE.items()}
SAFETENSORS_DTYPES: dict[str, str] = {name: code for name, (_, code) in _TABLE.items()}
