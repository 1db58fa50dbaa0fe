"""A mode out of a fixed set of words: :class:`TextEnum`."""

from __future__ import annotations

import enum

__all__ = ["TextEnum"]


class TextEnum(str, enum.Enum):
    """A member is its word: equal to it, and printed as it (in flags, logs and replies)."""

    def __str__(self) -> str:
        return self.value
