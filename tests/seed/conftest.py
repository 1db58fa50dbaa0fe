"""Runs the seed's test file unchanged against our module.

The seed imports ``torchtitan_npu.patches.optimizer.swap_optimizer``, its name in the
project it came from. Here that name is an alias: the very same module object as
``swap_state.client.swap_optimizer`` (so the seed's monkeypatches hit our module).
"""

from __future__ import annotations

import os
import socket
import sys
import types

from swap_state.client import swap_optimizer

_ALIAS = "torchtitan_npu.patches.optimizer.swap_optimizer"


def _install_alias() -> None:
    parent: types.ModuleType | None = None
    parts = _ALIAS.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that submodule imports resolve
        sys.modules[name] = module
        if parent is not None:
            setattr(parent, parts[depth - 1], module)
        parent = module
    sys.modules[_ALIAS] = swap_optimizer
    assert parent is not None
    setattr(parent, parts[-1], swap_optimizer)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_install_alias()
# The seed's gloo group defaults to port 12355; a free port avoids clashes with
# anything else on the machine (an explicit MASTER_PORT still wins).
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(_free_port()))
