"""torchtitan 0.2's custom config module under the name users put in their TOML
(``custom_config_module = "swap_state.client.torchtitan_config"``); it lives in
:mod:`swap_state.client.torchtitan.config`.
"""

from swap_state.client.torchtitan.config import JobConfig, Optimizer, shared_job_id

__all__ = ["Optimizer", "JobConfig", "shared_job_id"]
