"""Test config registry for torchtitan 0.3 (``--module group_registry --config <function>``;
this folder is on the launcher's sys.path): llama3's debug model with several param groups,
as a user's own registry would write them, plain and as a swap-state config (whose settings
torchtitan's CLI then also takes as ``--optimizer.<name>``)."""

from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from swap_state.client.torchtitan_override import with_swap_state


def llama3_debugmodel_groups():
    """Norm weights under Adam without weight decay, embeddings under AdamW at half the rate,
    the rest under AdamW (each group's own lr, betas, weight decay)."""
    config = llama3_debugmodel()
    config.optimizer.param_groups = [
        ParamGroupConfig(pattern=r"norm", optimizer_name="Adam", optimizer_kwargs={"lr": 0.004, "betas": (0.8, 0.9)}),
        ParamGroupConfig(pattern=r"tok_embeddings", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.004, "weight_decay": 0.05}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.008, "eps": 1e-6, "weight_decay": 0.1}),
    ]
    return config


def llama3_debugmodel_groups_swap_state():
    """The same job as a swap-state config built by the registry (no override needed)."""
    return with_swap_state(llama3_debugmodel_groups(), swap_optimizer_backend="local")
