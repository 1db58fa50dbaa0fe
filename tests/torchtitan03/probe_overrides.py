"""A torchtitan 0.3 override that changes nothing, for the tests that a caller's
``--override.imports`` (with JSON kwargs) applies beside the launcher's CPU attention one.

It claims the optimizer container's config (one node, ``optimizer``) and returns it as is, so
the run's numbers are the plain job's; torchtitan logs the claim with its kwargs.
"""

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import override


@override(target=OptimizersContainer.Config, description="test probe: identity")
def identity_probe(cfg: OptimizersContainer.Config, *, tag: str = "") -> OptimizersContainer.Config:
    return cfg
