"""``SwapOptimizersContainer``: torchtitan's container shape (one optimizer per model part, a flat FQN-keyed state dict)
without torchtitan, whose Adam moments live in a moment store; composed of the host caches, the step pipeline and the
state loader."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import types
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from swap_state.client.device import DeviceBackend, get_device_backend
from swap_state.client.optim import flat_state_dict as _flat
from swap_state.client.optim.checkpoint_template import match_template
from swap_state.client.optim.host_cache import STEP_KEY, HostCacheEntry, HostCaches, group_map, step_tensor
from swap_state.client.optim.kernels import pin_default_implementation
from swap_state.client.optim.moment_store import MomentStore, PinnedHostMemory
from swap_state.client.optim.state_loading import StateLoader
from swap_state.client.optim.step_pipeline import DEFAULT_SWAP_TIMES, StepPipeline

__all__ = ["SwapOptimizersContainer", "UnswappedOptimizers", "bind_swap_step"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class UnswappedOptimizers:
    """The optimizers of parameters swap-state does not swap (torchtitan 0.3's ``DistMuon``
    groups): stepped after the container's own, checkpointed in its flat dict through
    ``flat_state_dict`` / ``load_flat_state_dict``; nothing of theirs is in snapshots."""

    optimizers: list[Optimizer] = dataclasses.field(default_factory=list)
    flat_state_dict: Callable[[Optimizer], dict[str, Any]] | None = None
    load_flat_state_dict: Callable[[Optimizer, Mapping[str, Any]], None] | None = None

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {key: value for optimizer in self.optimizers for key, value in self.flat_state_dict(optimizer).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for optimizer in self.optimizers:
            self.load_flat_state_dict(optimizer, state_dict)


class SwapOptimizersContainer(Optimizer):
    """Optimizers of the model parts whose Adam/AdamW moments live in ``store`` (default: the
    trainer's pinned host memory) and stream through the accelerator in slices every step.

    Args:
        model_parts: the model's parts (pipeline stages); one optimizer each.
        optimizer_cls: ``torch.optim.Adam`` or ``torch.optim.AdamW`` (or a subclass).
        optimizer_kwargs: its keyword arguments (``lr``, ``betas``, ``fused``, ...).
        swap_optimizer_times: slices the parameters are cut into per step (>= 1).
        param_groups: a model part's param groups (default: one of every trainable parameter).
        device_backend: moves state (default: the process's device).
        pipeline: None runs the load/update/offload pipeline iff the device is an accelerator.
        moment_dtype: ``torch.bfloat16`` keeps the moments in bfloat16 (None: the parameter's).
        unswapped: optimizers of parameters not swapped (:class:`UnswappedOptimizers`).
        store: where the moments live (:class:`~swap_state.client.optim.moment_store.MomentStore`).
    """

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type[Optimizer], optimizer_kwargs: dict[str, Any],
                 swap_optimizer_times: int = DEFAULT_SWAP_TIMES, *,
                 param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
                 device_backend: DeviceBackend | None = None, pipeline: bool | None = None,
                 moment_dtype: torch.dtype | None = None, unswapped: UnswappedOptimizers | None = None,
                 store: MomentStore | None = None) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Adam)):
            name = getattr(optimizer_cls, "__name__", optimizer_cls)
            raise NotImplementedError(f"Optimizer {name} not added.")
        if int(swap_optimizer_times) < 1:
            raise ValueError(f"swap_optimizer_times must be >= 1, got {swap_optimizer_times}")
        if moment_dtype is not None and moment_dtype not in (torch.float32, torch.bfloat16):
            allowed = "torch.float32 or torch.bfloat16 (or None: the parameter's)"
            raise ValueError(f"moment_dtype must be {allowed}, got {moment_dtype}")
        self.swap_optimizer_times = int(swap_optimizer_times)
        self.moment_dtype = moment_dtype
        self.unswapped = unswapped or UnswappedOptimizers()
        self.device_backend = device_backend or get_device_backend()
        self.param_to_cpu_states_map: dict[torch.Tensor, dict[str, Any]] = {}
        self.param_to_device_states_map: dict[torch.Tensor, dict[str, Any]] = {}
        self._in_container_step = False
        self._loading_keys: frozenset[str] | None = None  # the optimizer keys of a checkpoint being loaded
        self.model_parts = model_parts
        build_groups = param_groups or _trainable_group
        self.optimizers = [optimizer_cls(build_groups(model), **optimizer_kwargs) for model in model_parts]
        all_params = [param for optim in self for group in optim.param_groups for param in group["params"]]
        # The container's own step hooks (LR schedulers, torchtitan's MoE load balancing).
        Optimizer.__init__(self, all_params, optimizer_kwargs)
        self._build_parts(store or PinnedHostMemory(self.device_backend), self.device_backend, pipeline)
        self._install_host_caches()

    def _build_parts(self, store: MomentStore, backend: DeviceBackend, pipeline: bool | None) -> None:
        self.store = store
        self._host_caches = HostCaches(store, self.optimizers, self.param_to_cpu_states_map,
                                       self.param_to_device_states_map, self.moment_dtype)
        self._steps = StepPipeline(self._host_caches, backend, self.model_parts, self.swap_optimizer_times,
                                   pipeline=pipeline)
        self._loader = StateLoader(self._host_caches, backend, self.model_parts)

    def _install_host_caches(self) -> None:
        """Group steps, host caches, placeholders and bound steps for every optimizer."""
        entries: list[HostCacheEntry] = []
        for index, (model, optim) in enumerate(zip(self.model_parts, self.optimizers, strict=True)):
            optim.param_to_group_map = group_map(optim)  # type: ignore[attr-defined]
            for group in optim.param_groups:
                group.setdefault(STEP_KEY, step_tensor(0))
                pin_default_implementation(group)
            pairs = [(gi, p) for gi, g in enumerate(optim.param_groups) for p in g["params"]]
            entries.extend(self._host_caches.entries(index, model, optim, pairs))
        seen: set[int] = set()
        for entry in entries:
            if id(entry.param) in seen:
                raise ValueError(f"parameter {entry.fqn!r} is in more than one optimizer or group")
            seen.add(id(entry.param))
        self._host_caches.install(entries)
        for optim in self.optimizers:
            optim.step = bind_swap_step(weakref.WeakMethod(self._swap_step), optim)  # type: ignore[method-assign]
        mode = "pipelined" if self._steps.enabled() else "in place on CPU"
        logger.info("swap optimizer: %d parameters, %.1f MiB of moments in host memory, %d slices, %s",
                    len(entries), sum(e.nbytes for e in entries) / 2**20, self.swap_optimizer_times, mode)

    # -- step ----------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step every optimizer through the swap pipeline; the store hears ``after_step`` once."""
        self._in_container_step = True
        try:
            # Not super().step(): torch may have wrapped it with the step hooks (run twice).
            for optimizer in self.optimizers:
                optimizer.step(*args, **kwargs)
            self.unswapped.step()
        finally:
            self._in_container_step = False
        self.store.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self:  # the unswapped ones too
            optimizer.zero_grad(set_to_none=set_to_none)

    def __iter__(self) -> Iterator[Optimizer]:
        """Every optimizer, the unswapped ones last (torchtitan's LR schedulers iterate)."""
        return itertools.chain(self.optimizers, self.unswapped.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers) + len(self.unswapped.optimizers)

    def _swap_step(self, optim: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """``optim.step(closure)`` through the pipeline; outside ``step()``, then ``after_step``."""
        loss = self._steps.run(optim, closure)
        if not self._in_container_step:
            self.store.after_step()
        return loss

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Flat ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>`` dict over the host cache
        (less what a loading checkpoint lacks: :meth:`loading_checkpoint`)."""
        flat = _flat.flat_state_dict(self.model_parts, self.optimizers, self.param_to_cpu_states_map)
        flat.update(self.unswapped.state_dict())
        return flat if self._loading_keys is None else match_template(flat, self._loading_keys)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a flat state dict; validated first, a failure leaves the container untouched."""
        try:
            self._loader.load(state_dict)
            self.unswapped.load_state_dict(state_dict)
        finally:
            # Caches may be new, groups changed (a rollback restores copies): replan.
            self._steps.invalidate()

    @contextlib.contextmanager
    def loading_checkpoint(self, keys: Collection[str]) -> Iterator[None]:
        """``state_dict()`` is the template of a checkpoint holding optimizer keys in the block
        (:func:`match_template`: DCP's strict load fails on every key the checkpoint lacks)."""
        previous, self._loading_keys = self._loading_keys, frozenset(keys)
        try:
            yield
        finally:
            self._loading_keys = previous


def _trainable_group(model: nn.Module) -> list[dict[str, Any]]:
    """torchtitan's default: one param group of every trainable parameter."""
    return [{"params": [param for param in model.parameters() if param.requires_grad]}]


def bind_swap_step(swap_step_of: weakref.WeakMethod, optim: Optimizer) -> Callable[..., Any]:
    """``optim.step`` bound to the swap pipeline (``swap_step_of``: the container's, held weakly),
    with torch's step hooks: a method, so that LR schedulers can wrap it."""

    def swap_step(optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        run = swap_step_of()
        if run is None:
            raise RuntimeError("the SwapOptimizersContainer of this optimizer no longer exists")
        return run(optimizer, closure)

    swap_step.__qualname__ = f"{type(optim).__name__}.swap_step"
    return types.MethodType(Optimizer.profile_hook_step(swap_step), optim)
