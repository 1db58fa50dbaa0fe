"""Fixtures for torchtitan 0.3's own trainer on the CPU (see titan03_kit.py and launcher.py).

    titan03_python                    session: the 0.3 venv's python; the tests are skipped,
                                      with the command that builds it, when it is missing
    titan03_assets                    session: the 0.2 kit's offline tokenizer + c4_test data
    titan03_runner(dump, *flags, ...) session-wide run_trainer03, for module-scoped references
    run_trainer03(dump, *flags, steps=6, env=None, timeout=240, expect_returncode=0, check=True,
                  nproc=1)
        -> Losses                     a list of float.hex() strings, one per step run, with
                                      .steps (step numbers) and .run (TrainerRun: output,
                                      returncode, wall_s, argv)

``dump`` is the run's ``--dump-folder`` (checkpoints go to ``dump/<checkpoint.folder>``, so a
rerun with the same ``dump`` resumes). ``flags`` come after the base job's and override them,
e.g. ``"--checkpoint.enable", "--checkpoint.interval", "3"``. Every run's process group is
killed when its test (or, for ``titan03_runner``, the session) ends.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers", reason="tokenizers (a torchtitan dependency) builds the test tokenizer")

from titan03_kit import (
    ProcessGroups,
    as_losses,
    launch03,
    locate_titan03_python,
    missing_reason,
    torchtitan_version,
)

# tests/torchtitan (the 0.2 kit) is on sys.path once titan03_kit is imported.
from titan_testkit import TitanAssets, build_titan_assets


@pytest.fixture(scope="session")
def titan03_python():
    python = locate_titan03_python()
    reason = missing_reason(python)
    if reason:
        pytest.skip(reason)
    version = torchtitan_version(python)
    if not version.startswith("0.3"):
        pytest.fail(f"{python} has torchtitan {version}, not 0.3.x")
    return python


@pytest.fixture(scope="session")
def titan03_assets(tmp_path_factory) -> TitanAssets:
    return build_titan_assets(tmp_path_factory.mktemp("titan03-assets"))


def _runner(python, assets: TitanAssets, groups: ProcessGroups):
    def run(dump_folder, *flags: str, steps: int = 6, env: dict[str, str] | None = None,
            timeout: float = 240.0, expect_returncode: int = 0, check: bool = True, nproc: int = 1):
        return as_losses(launch03(python, assets, dump_folder, *flags, steps=steps, env=env,
                                  timeout=timeout, check=check,
                                  expect_returncode=expect_returncode, groups=groups, nproc=nproc))

    return run


@pytest.fixture(scope="session")
def titan03_runner(titan03_python, titan03_assets):
    groups = ProcessGroups()
    yield _runner(titan03_python, titan03_assets, groups)
    groups.kill_all()


@pytest.fixture
def run_trainer03(titan03_python, titan03_assets):
    groups = ProcessGroups()
    yield _runner(titan03_python, titan03_assets, groups)
    groups.kill_all()
