"""torchtitan 0.2's custom config module, under the name users put in their TOML
(``custom_config_module = "swap_state.client.torchtitan_config"``).

The module lives in :mod:`swap_state.client.torchtitan.config`; importing this name imports it
(which installs the ``build_optimizers`` and checkpoint wrappers) and hands torchtitan its
``JobConfig``.
"""

from swap_state.client.torchtitan.config import JobConfig, Optimizer, shared_job_id

__all__ = ["Optimizer", "JobConfig", "shared_job_id"]
