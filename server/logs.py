"""Structured logs: one line per event, ``key=value`` pairs (logfmt), e.g.::

    ts=2025-01-01T12:00:00.123Z level=info logger=swap_state.server event=attach job_id=llama rank=3

Values with spaces, quotes or ``=`` are quoted with escapes: a line stays one parseable line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["LogfmtFormatter", "configure_logging", "log_event", "logfmt_value"]

_LEVEL_NAMES = {"WARNING": "warn", "CRITICAL": "error"}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r"}


def logfmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    if text and all(ch.isprintable() and ch not in ' "=\\' for ch in text):
        return text
    escaped = "".join(_ESCAPES.get(ch) or (ch if ch.isprintable() else f"\\x{ord(ch):02x}") for ch in text)
    return f'"{escaped}"'


class LogfmtFormatter(logging.Formatter):
    """Formats records made by :func:`log_event` (and plain ones, as ``msg=...``)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        level = _LEVEL_NAMES.get(record.levelname, record.levelname.lower())
        parts = [f"ts={stamp}", f"level={level}", f"logger={record.name}"]
        fields = getattr(record, "swap_state_fields", None)
        if fields is not None:
            parts.append(f"event={logfmt_value(record.msg)}")
            parts.extend(f"{key}={logfmt_value(value)}" for key, value in fields.items())
        else:
            parts.append(f"msg={logfmt_value(record.getMessage())}")
        if record.exc_info:
            parts.append(f"exc={logfmt_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event line. ``exc_info=True`` in ``fields`` attaches the current exception."""
    exc_info = fields.pop("exc_info", None)
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"swap_state_fields": fields}, exc_info=exc_info)


def configure_logging(level: str) -> None:
    """Route the ``swap_state`` loggers to stderr in logfmt at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger("swap_state")
    root.handlers = [handler]  # replaces any earlier call's
    root.setLevel(level.upper())
    root.propagate = False
