"""torchtitan 0.2.x glue: the custom config module and the build_optimizers dispatch."""

from __future__ import annotations

import pytest
import torch
import torchtitan.components.optimizer as tt_optimizer

import swap_state.client.torchtitan.config  # noqa: F401  (installs the wrapper)
from swap_state.client.remote.container import RemoteSwapOptimizersContainer
from swap_state.client.swap_optimizer import SwapOptimizersContainer

from .workload import Workload, build, mismatches, parse_titan_toml as _parse, train


def test_toml_switches_build_the_remote_container_bitwise(server, tmp_path):
    config = _parse(
        tmp_path,
        'name = "AdamW"\nlr = 0.01\nbeta1 = 0.9\nbeta2 = 0.95\nweight_decay = 0.1\n'
        'swap_optimizer = true\nswap_optimizer_times = 2\nswap_optimizer_backend = "remote"\n'
        f'swap_state_server = "{server.address}"\nswap_state_job_id = "tt-glue"\n',
    )
    assert config.optimizer.swap_state_checkpoint == "full"
    w = Workload()
    model, ref_model = build(w), build(w)
    container = tt_optimizer.build_optimizers([model], config.optimizer, None, None)
    assert isinstance(container, RemoteSwapOptimizersContainer)
    assert container.remote_config.job_id == "tt-glue"
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    train(model, container, w, range(1, 6))
    train(ref_model, ref, w, range(1, 6))
    assert mismatches(model, container, ref_model, ref) == []
    container.close()


def test_local_backend_and_swap_off(tmp_path):
    config = _parse(tmp_path, 'name = "Adam"\nswap_optimizer = true\nswap_optimizer_backend = "local"\n')
    local = tt_optimizer.build_optimizers([build(Workload())], config.optimizer, None, None)
    assert type(local) is SwapOptimizersContainer
    config = _parse(tmp_path, 'name = "AdamW"\nswap_optimizer = false\n')
    plain = tt_optimizer.build_optimizers([build(Workload())], config.optimizer, None, None)
    assert not isinstance(plain, SwapOptimizersContainer)


def test_unknown_backend_is_a_clear_error(tmp_path):
    config = _parse(tmp_path, 'swap_optimizer = true\nswap_optimizer_backend = "local"\n')
    config.optimizer.swap_optimizer_backend = "nvme"
    with pytest.raises(ValueError, match="swap_optimizer_backend"):
        tt_optimizer.build_optimizers([build(Workload())], config.optimizer, None, None)


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ('swap_state_checkpoint = "bogus"', r"optimizer\.swap_state_checkpoint must be one of 'full', 'snapshot', got 'bogus'"),
        ('swap_optimizer_backend = "nvme"', r"optimizer\.swap_optimizer_backend must be one of 'local', 'remote', got 'nvme'"),
        ("swap_optimizer_times = 0", r"optimizer\.swap_optimizer_times must be an integer >= 1, got 0"),
    ],
)
def test_bad_toml_values_name_the_field_and_the_allowed_values(tmp_path, toml, match):
    """torchtitan checks Literal fields on the command line only; a TOML value reaches the
    wrapper as written, which refuses it before building anything."""
    config = _parse(tmp_path, f'name = "AdamW"\nswap_optimizer = true\n{toml}\n')
    with pytest.raises(ValueError, match=match):
        tt_optimizer.build_optimizers([build(Workload())], config.optimizer, None, None)


def test_unknown_optimizer_name_from_toml(tmp_path):
    config = _parse(tmp_path, 'name = "Lion"\nswap_optimizer = true\n')
    with pytest.raises(NotImplementedError, match="Optimizer Lion not added."):
        tt_optimizer.build_optimizers([build(Workload())], config.optimizer, None, None)


def test_a_snapshot_mode_save_waits_for_a_restarting_server_then_fails_naming_it(start_server, tmp_path):
    import threading
    import time

    from swap_state.client.errors import ServerUnavailableError
    from swap_state.common.retry import wait_until

    server = start_server()
    config = _parse(
        tmp_path,
        'name = "AdamW"\nlr = 0.01\nswap_optimizer = true\nswap_optimizer_times = 2\n'
        'swap_optimizer_backend = "remote"\nswap_state_checkpoint = "snapshot"\n'
        f'swap_state_server = "{server.address}"\nswap_state_job_id = "tt-wait"\n'
        "swap_state_server_wait_s = 2.5\n",
    )
    w = Workload()
    model = build(w)
    container = tt_optimizer.build_optimizers([model], config.optimizer, None, None)
    assert container.remote_config.server_wait_s == 2.5
    train(model, container, w, range(1, 3))
    server.kill()
    assert wait_until(container.session.server_gone, timeout_s=10)
    train(model, container, w, range(3, 4))  # training never waits for the server
    began = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="tried again for 2.5 s") as err:
        container.state_dict()  # CheckpointManager.save's call: waits 2.5 s, then fails
    assert 2.5 <= time.monotonic() - began < 10 and server.address in str(err.value)

    saved: dict = {}
    # This save finds the server back within its wait: one long enough for a restart on a
    # loaded machine (the 2.5 s above is the failing case's, not a restart's bound).
    container.client.config.server_wait_s = 60.0
    save = threading.Thread(target=lambda: saved.update(container.state_dict()))
    save.start()
    time.sleep(0.5)
    server.restart()
    save.join(30)
    assert saved["swap_state.snapshot_id"] == "tt-wait/step-3"
    container.wait_checkpoint_durable(timeout_s=30)
    container.close()
