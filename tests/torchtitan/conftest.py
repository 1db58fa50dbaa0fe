"""Fixtures for torchtitan's own trainer on the CPU (see titan_testkit.py and launcher.py).

    titan_assets                      session: tokenizer + c4_test dataset, generated offline
    run_trainer(dump, *flags, steps=6, env=None, timeout=240, expect_returncode=0, check=True,
                nproc=1, hosts=None)          nproc > 1: under torchrun (gloo), rank 0's losses;
                                      hosts=[env, ...]: one torchrun launch per host (--nnodes),
                                      each with its env (e.g. its host's SWAP_STATE_SERVER)
        -> Losses                     a list of float.hex() strings, one per step run, with
                                      .steps (step numbers) and .run (TrainerRun: output,
                                      returncode, wall_s, argv)

``dump`` is the run's ``--job.dump_folder`` (checkpoints go to ``dump/<checkpoint.folder>``,
so a rerun with the same ``dump`` resumes). ``flags`` come after the base job's and override
them, e.g. ``"--checkpoint.enable", "--checkpoint.interval=4"``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan (the client extra) is not installed")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

from titan_testkit import Losses, TitanAssets, as_losses, build_titan_assets, launch  # noqa: E402


@pytest.fixture(scope="session")
def titan_assets(tmp_path_factory) -> TitanAssets:
    return build_titan_assets(tmp_path_factory.mktemp("titan-assets"))


@pytest.fixture
def run_trainer(titan_assets):
    def run(dump_folder, *flags: str, steps: int = 6, env: dict[str, str] | None = None,
            timeout: float = 240.0, expect_returncode: int = 0, check: bool = True, nproc: int = 1,
            hosts: list[dict[str, str]] | None = None) -> Losses:
        return as_losses(launch(titan_assets, dump_folder, *flags, steps=steps, env=env, timeout=timeout,
                                expect_returncode=expect_returncode, check=check, nproc=nproc, hosts=hosts))

    return run
