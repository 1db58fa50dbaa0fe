"""The seed copy in this folder must stay byte-identical to the shared seed."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COPY = HERE / "test_swap_optimizer_seed.py"
# The repository is cloned with shared/ beside it: <root>/../shared/seed/.
SHARED = HERE.parents[1].parent / "shared" / "seed" / "test_swap_optimizer_seed.py"


#: sha256 of the shared seed, recorded from ../shared/seed when the copy was made: a clone
#: without ../shared beside it still checks its copy against the seed.
SEED_SHA256 = "b3509b27000126ef24bb628e88a9fd80a1c84a41ce877234219984de4bc318ad"


def test_seed_copy_is_byte_identical() -> None:
    assert hashlib.sha256(COPY.read_bytes()).hexdigest() == SEED_SHA256, f"{COPY} is not the seed"
    if SHARED.is_file():  # beside the shared folder: the seed itself, byte for byte
        assert COPY.read_bytes() == SHARED.read_bytes(), f"{COPY} differs from {SHARED}"


def test_seed_alias_is_our_module() -> None:
    from swap_state.client import swap_optimizer

    assert sys.modules["torchtitan_npu.patches.optimizer.swap_optimizer"] is swap_optimizer
    from torchtitan_npu.patches.optimizer import swap_optimizer as aliased  # type: ignore[import-not-found]

    assert aliased is swap_optimizer
