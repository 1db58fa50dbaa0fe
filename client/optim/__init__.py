"""The in-process swap optimizer: host cache, pipelined step, flat state dict, load planner,
and the container that holds them (the seed's ``SwapOptimizersContainer``)."""
