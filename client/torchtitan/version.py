"""Which torchtitan line is installed (by its features: source installs say 0.0.0), and the
error that names the other line's switch."""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["SWITCHES", "WrongTorchtitanLine", "require_line", "torchtitan_line"]

#: What turns a run into a swap-state run, per line.
SWITCHES = {
    "0.2": "--job.custom_config_module=swap_state.client.torchtitan_config with "
    "optimizer.swap_optimizer = true (TOML [optimizer] section)",
    "0.3": "--override.imports swap_state.client.torchtitan_override.swap_state"}


class WrongTorchtitanLine(ImportError):
    """A swap-state entry point of one torchtitan line imported under the other."""


@functools.cache
def torchtitan_line() -> str:
    """``"0.3"`` where torchtitan has ``torchtitan.config.override``, else ``"0.2"``."""
    return "0.3" if importlib.util.find_spec("torchtitan.config.override") is not None else "0.2"


def require_line(line: str, entry: str) -> None:
    """Raise :class:`WrongTorchtitanLine` naming the installed line's switch unless ``line`` is it."""
    installed = torchtitan_line()
    if installed != line:
        raise WrongTorchtitanLine(f"{entry} is for torchtitan {line}, but torchtitan {installed} is installed: "
                                  f"use {SWITCHES[installed]}")
