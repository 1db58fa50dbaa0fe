"""What a segment says about itself, so that a successor server can adopt it (:mod:`.segment`,
"Adoption"). The successor trusts nothing in it: :meth:`SegmentDescriptor.decode` checks each
field's shape, the server then validates the values as for an Attach and an Allocate.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

__all__ = ["DESCRIPTOR_FORMAT", "MAX_DESCRIPTOR_BYTES", "SegmentDescriptor"]

DESCRIPTOR_FORMAT = "swap-state-segment/1"
#: A descriptor longer than this is refused unread (a hostile header must not make a server
#: allocate gigabytes): 1M tensors at 64 bytes each.
MAX_DESCRIPTOR_BYTES = 64 << 20
_PLAIN_FIELDS = (("job_id", str), ("rank", int), ("world_size", int), ("local_world_size", int), ("layout_hash", str))


@dataclasses.dataclass(frozen=True)
class SegmentDescriptor:
    """The session a segment belongs to and the tensors it was planned for."""

    job_id: str
    rank: int
    world_size: int
    local_world_size: int
    """Ranks of the job on the server (its host)."""
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    """(name, dtype, shape) in segment order: the Allocate request, checked."""
    layout_hash: str
    """:func:`~swap_state.common.segment.layout_hash` of ``tensors`` (hex)."""
    tenant: str = ""
    """The tenant that owns the session (``--tenants``; "" without tenants)."""

    def encode(self) -> bytes:
        return json.dumps({
            "format": DESCRIPTOR_FORMAT, **{key: getattr(self, key) for key, _ in _PLAIN_FIELDS},
            "tensors": [[name, dtype, list(shape)] for name, dtype, shape in self.tensors],
            **({"tenant": self.tenant} if self.tenant else {})}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SegmentDescriptor:
        """The descriptor in ``raw``; ValueError naming what is wrong (shape only)."""
        if len(raw) > MAX_DESCRIPTOR_BYTES:
            raise ValueError(f"descriptor of {len(raw)} bytes (at most {MAX_DESCRIPTOR_BYTES})")
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"descriptor is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != DESCRIPTOR_FORMAT:
            raise ValueError(f"descriptor is not of format {DESCRIPTOR_FORMAT}")
        return cls(**{key: _typed(doc, key, kind) for key, kind in _PLAIN_FIELDS},
                   tensors=_tensors(_typed(doc, "tensors", list)),
                   tenant=_typed(doc, "tenant", str) if "tenant" in doc else "")


def _typed(doc: dict, key: str, kind: type):
    value = doc.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"descriptor field {key!r} is not a {kind.__name__}")
    return value


def _tensors(items: Sequence[object]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], str) and isinstance(item[2], list)
                and all(isinstance(d, int) and not isinstance(d, bool) for d in item[2])):
            raise ValueError("descriptor tensor is not [name, dtype, [dims...]]")
        out.append((item[0], item[1], tuple(item[2])))
    return tuple(out)
