"""torchtitan 0.3 overrides the CPU launcher activates (``--override.imports``; not product code).

llama3's attention is ``FlexAttention`` (``model_registry(attn_backend="flex")``), a
``torch.compile``'d ``flex_attention`` that has no CPU backward. ``cpu_sdpa_attention`` swaps
each inner attention for ``ScaledDotProductAttention`` (the MATH kernel on the CPU): plain
causal attention over the whole sequence where flex masks per document. That changes what
the tiny test model computes, not what the tests check (determinism, resume, the optimizer's
state), and the trainer's ``post_dataloading_process`` already builds no masks for a
maskless backend.

The launcher names it ``cpu_overrides.cpu_sdpa_attention`` (this folder is on its sys.path);
it cannot import this module to ask, since that would import torchtitan before its CPU shims.
"""

from torchtitan.config import derive, override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention


@override(target=FlexAttention.Config, description="CPU tests: SDPA (flex has no CPU backward)")
def cpu_sdpa_attention(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    # derive: keeps the Module.Config fields (param_init, sharding_config) of the node.
    return derive(cfg, ScaledDotProductAttention.Config)
