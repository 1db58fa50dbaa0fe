"""torchtitan glue: the custom config module, the ``build_optimizers`` and checkpoint wrappers,
the whole-state model entry."""
