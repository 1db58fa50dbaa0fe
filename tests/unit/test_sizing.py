"""``swap-state plan`` and the sizing rule it shares with the trainer's log at attach."""

from __future__ import annotations

import pytest

from swap_state.client import cli
from swap_state.common.sizes import GiB
from swap_state.common.sizing import plan_sizes


def test_the_numbers_of_an_fsdp_job_with_and_without_snapshots():
    moments_only = plan_sizes(8 * 10**9, world_size=8, ranks_per_host=8)
    assert moments_only.params_per_rank == 10**9 and moments_only.moments_per_rank == 8 * 10**9
    assert moments_only.model_copy_per_rank == 0 and moments_only.copy_pool == GiB  # the server's default
    assert moments_only.shm_size >= 8 * 8 * 10**9 + GiB and moments_only.shm_size % GiB == 0
    snapshots = plan_sizes(8 * 10**9, world_size=64, ranks_per_host=8, model_bytes_per_param=4, snapshots=True,
                           persist_bytes_per_s=2e9, fwd_bwd_s=1.5)
    state = 8 * snapshots.per_rank
    assert snapshots.per_rank == 125 * 10**6 * 12  # two fp32 moments + an fp32 copy per parameter
    assert snapshots.copy_pool == state - 3 * 10**9  # what 2 GB/s cannot persist in 1.5 s
    assert state + snapshots.copy_pool <= snapshots.shm_size < state + snapshots.copy_pool + 2 * GiB
    bf16 = plan_sizes(10**9, world_size=1, ranks_per_host=1, moment_bytes=2, amsgrad=True)
    assert bf16.moments_per_rank == 6 * 10**9
    with pytest.raises(ValueError, match="ranks per host"):
        plan_sizes(10**9, world_size=4, ranks_per_host=8)


def test_the_command_prints_per_rank_per_host_and_the_flags(capsys):
    assert cli.main(["plan", "--params", "8B", "--world-size", "64", "--checkpoint", "snapshot",
                     "--persist-gbps", "2", "--step-seconds", "1.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("per rank:  125,000,000 parameters: moments")
    assert "8 ranks" in out[1] and "copy pool" in out[1]
    assert out[2].startswith("server:    swap-state-server --shm-size ") and "--cow-budget" in out[2]


def test_a_torchtitan_flavour_is_counted_on_the_meta_device(capsys):
    pytest.importorskip("torchtitan.protocols.train_spec", reason="needs torchtitan 0.2 (the client extra)")
    assert cli.main(["plan", "--model", "llama3:debugmodel", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "per rank:  6," in out  # the debug model's ~6.2M parameters
    with pytest.raises(SystemExit, match="give --params instead"):
        cli.main(["plan", "--model", "llama3:nosuch", "--world-size", "1"])


def test_the_shortest_replica_interval_is_the_host_state_over_the_link_in_steps(capsys):
    # 4 ranks of 2^30 parameters' moments (8 GiB each): 32 GiB a host, 34.36 s at 1 GB/s; 10 s steps.
    assert cli.main(["plan", "--params", str(4 << 30), "--world-size", "4", "--replica-gbps", "1",
                     "--step-seconds", "10"]) == 0
    out = capsys.readouterr().out
    assert "takes 34.4 s to send at 1 GB/s: replica_interval >= 4 steps of 10 s" in out, out
    assert "each peer: --replica-size 96G" in out, out  # two steps of 32 GiB and the spare pages of a third
