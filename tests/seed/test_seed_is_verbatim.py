"""The seed copy in this folder must stay byte-identical to the shared seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
COPY = HERE / "test_swap_optimizer_seed.py"
# The repository is cloned with shared/ beside it: <root>/../shared/seed/.
SHARED = HERE.parents[1].parent / "shared" / "seed" / "test_swap_optimizer_seed.py"


def test_seed_copy_is_byte_identical() -> None:
    if not SHARED.is_file():
        pytest.skip(f"shared seed not found at {SHARED} (needs ../shared beside the repository)")
    assert COPY.read_bytes() == SHARED.read_bytes(), f"{COPY} differs from {SHARED}"


def test_seed_alias_is_our_module() -> None:
    from swap_state.client import swap_optimizer

    assert sys.modules["torchtitan_npu.patches.optimizer.swap_optimizer"] is swap_optimizer
    from torchtitan_npu.patches.optimizer import swap_optimizer as aliased  # type: ignore[import-not-found]

    assert aliased is swap_optimizer
