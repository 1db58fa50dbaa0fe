"""One small accelerator layer for Ascend NPU, CUDA and CPU: NPU, then CUDA, then CPU, unless
``SWAP_STATE_DEVICE`` forces one (an error where it is not there, never a silent fallback). On CPU,
streams and events are :class:`NullStream`, so the pipelined accelerator path runs unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Literal, cast

import torch

from swap_state.client.host_register import (
    BOUNCE_SLOT_BYTES, BOUNCE_SLOTS, PAGE_SIZE, REGISTER_CHUNK_BYTES, BounceRing, HostRegistration,
    HostRegistrationError, ProbeConfig, _acl_host_register, _acl_host_unregister, _cuda_error_string,
    _cuda_host_register, _cuda_host_unregister, needs_bounce, page_chunks, registered_host_buffer, release_host_buffers)

__all__ = [
    "host_bytes", "DEVICE_ENV_VAR", "PAGE_SIZE", "REGISTER_CHUNK_BYTES", "DeviceBackend", "DeviceType",
    "HostRegistration", "HostRegistrationError", "NullEvent", "NullStream", "get_device_backend", "page_chunks",
    "select_device_type"]

logger = logging.getLogger(__name__)

DeviceType = Literal["npu", "cuda", "cpu"]

#: Environment variable that forces the backend: ``npu``, ``cuda`` or ``cpu``.
DEVICE_ENV_VAR = "SWAP_STATE_DEVICE"

_DEVICE_TYPES: tuple[DeviceType, ...] = ("npu", "cuda", "cpu")


class NullStream:
    """``torch.cuda.Stream`` and ``Event`` look-alike for CPU (:data:`NullEvent`): CPU work is
    done when the call that enqueued it returns, so every method returns at once."""

    def query(self) -> bool:
        return True

    def synchronize(self, *stream_or_event: Any) -> None:
        """Nothing to wait for, or to record."""

    record = wait_event = wait_stream = synchronize


NullEvent = NullStream


class DeviceBackend:
    """The accelerator of this process (or the CPU); tests override ``_register_chunk``,
    ``_unregister_chunk`` and ``_describe_return_code``."""

    def __init__(self, device_type: DeviceType, module: ModuleType | None = None, *,
                 chunk_bytes: int = REGISTER_CHUNK_BYTES) -> None:
        if device_type not in _DEVICE_TYPES:
            raise ValueError(f"unknown device type {device_type!r}; expected one of {_DEVICE_TYPES}")
        if device_type != "cpu" and module is None:
            module = torch.cuda if device_type == "cuda" else _import_torch_npu()
        self.type: DeviceType = device_type
        self.module: ModuleType | None = module
        self.chunk_bytes = chunk_bytes
        self._null_stream = NullStream()
        self._registrations: dict[int, HostRegistration] = {}
        self._lock = threading.Lock()
        self._bounced: dict[int, int] = {}  # start -> end of the host ranges whose copies bounce
        self._bounce_ring: BounceRing | None = None  # made on first use
        self._bounce_lock = threading.Lock()
        self.copy_probe = ProbeConfig()
        self._bounce_registered: bool | None = None  # the probe's verdict, once it has run

    def __repr__(self) -> str:
        return f"DeviceBackend(type={self.type!r})"

    @property
    def is_accelerator(self) -> bool:
        """True on NPU and CUDA: copies are asynchronous and streams are real."""
        return self.type != "cpu"

    @property
    def pin_memory_available(self) -> bool:
        """Pinned host memory exists only where an accelerator does."""
        return self.is_accelerator

    # -- devices, streams, events -------------------------------------------------------
    def _accel(self) -> Any:
        if self.module is None:
            raise RuntimeError(f"{self!r} has no accelerator module")
        return self.module

    def current_device(self) -> torch.device:
        return torch.device(self.type, self._accel().current_device()) if self.is_accelerator else torch.device("cpu")

    def stream(self) -> Any:
        return self._accel().Stream() if self.is_accelerator else NullStream()

    def current_stream(self) -> Any:
        """The stream work is enqueued on now (the compute stream outside a context)."""
        return self._accel().current_stream() if self.is_accelerator else self._null_stream

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` current in the calling thread: a new thread starts on device 0, so a
        helper thread's work (an Ascend ``Event.synchronize``, too) would go there for every rank."""
        if self.is_accelerator:
            self._accel().set_device(device)

    def event(self, *, blocking: bool = False) -> Any:
        """A new event (a :class:`NullEvent` on CPU). ``blocking=True``: ``synchronize()`` sleeps
        instead of spinning a core (for helper threads; a spinning wait returns sooner)."""
        if not self.is_accelerator:
            return NullEvent()
        # The default stays the plain call, which every CUDA / torch_npu version takes.
        return self._accel().Event(blocking=True) if blocking else self._accel().Event()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if not self.is_accelerator:
            return contextlib.nullcontext(stream)
        return cast(contextlib.AbstractContextManager[Any], self._accel().stream(stream))

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._accel().synchronize()

    def empty_cache(self) -> None:
        if self.is_accelerator:
            self._accel().empty_cache()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if self.is_accelerator:
            tensor.record_stream(stream)

    # -- host memory ---------------------------------------------------------------------
    def alloc_host(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, pin_memory=self.pin_memory_available)

    def alloc_host_bytes(self, nbytes: int, spans: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        """A zero-filled uint8 host buffer for many tensors (``spans``), pinned without torch's
        power-of-two rounding (a registered mapping; torch's pinned memory where the probe bounces)."""
        if not self.pin_memory_available:
            return self.alloc_host((nbytes,), torch.uint8)
        register = functools.partial(self.register_host_memory, spans=spans)
        buffer = registered_host_buffer(nbytes, register, self.unregister_host_memory)
        if self.bounces(buffer):
            return self.alloc_host((nbytes,), torch.uint8)  # ``buffer`` goes: unregistered
        return buffer

    def register_host_memory(self, ptr: int, nbytes: int, cuts: Sequence[int] = (),
                             spans: Sequence[tuple[int, int]] = ()) -> HostRegistration:
        """Register ``[ptr, ptr + nbytes)`` for DMA in chunks (:func:`page_chunks`), rolled back on a
        failure. On CPU nothing is called, but the checks apply, so CPU runs catch misuse."""
        chunks = page_chunks(ptr, nbytes, self.chunk_bytes, cuts=cuts, spans=spans)
        release_host_buffers()  # a safe point: no lock held
        with self._lock:
            if ptr in self._registrations:
                raise ValueError(f"host range at {ptr:#x} is already registered")
            done: list[tuple[int, int]] = []
            for chunk_ptr, chunk_size in chunks:
                rc = self._register_chunk(chunk_ptr, chunk_size)
                if rc != 0:
                    self._unregister_chunks(done, quiet=True)
                    end = chunks[-1][0] + chunks[-1][1]
                    whole = f" while registering [{ptr:#x}, {end:#x}) in {len(chunks)} chunk(s)"
                    raise self._error("register", chunk_ptr, chunk_size, rc, whole)
                done.append((chunk_ptr, chunk_size))
            registration = HostRegistration(ptr, sum(size for _, size in chunks), tuple(chunks))
            self._registrations[ptr] = registration
        logger.debug("registered %d bytes at %#x in %d chunk(s)", registration.nbytes, ptr, len(chunks))
        self._check_copies(registration)
        return registration

    @property
    def probes_registered_copies(self) -> bool:
        """Only Ascend's registrations are probed (older torch_npu synchronizes after their copies)."""
        return self.type == "npu"

    def _check_copies(self, registration: HostRegistration) -> None:
        """Where probed, a registration whose copies are not asynchronous goes through the bounce
        ring. Only the first is probed: the runtime treats every later one the same."""
        if not self.probes_registered_copies:
            return
        if self._bounce_registered is None:
            self._bounce_registered = needs_bounce(self, registration.ptr, registration.nbytes)
        if self._bounce_registered:
            with self._bounce_lock:
                self._bounced[registration.ptr] = registration.ptr + registration.nbytes

    def bounces(self, host: torch.Tensor) -> bool:
        """Whether ``host``'s first byte lies in a range whose copies bounce (thread-safe)."""
        if not self._bounced:
            return False
        ptr = host.data_ptr()
        with self._bounce_lock:
            return any(start <= ptr < end for start, end in self._bounced.items())

    def bounce_ring(self) -> BounceRing:
        """The bounce ring, its pinned slots made on first use."""
        with self._bounce_lock:
            if self._bounce_ring is None:
                slots = [self.alloc_host((BOUNCE_SLOT_BYTES,), torch.uint8) for _ in range(BOUNCE_SLOTS)]
                self._bounce_ring = BounceRing(slots, self.event)
            return self._bounce_ring

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` from the host, bounced where the probe said so."""
        if self.bounces(src):
            self.bounce_ring().to_device(dst, src, self.current_stream())
        else:
            dst.copy_(src, non_blocking=True)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` to the host; through the bounce ring it returns
        with ``dst`` written, so events recorded after it still hold."""
        if self.bounces(dst):
            self.bounce_ring().to_host(dst, src, self.current_stream())
        else:
            dst.copy_(src, non_blocking=True)

    def unregister_host_memory(self, ptr: int) -> None:
        """Unregister the range at ``ptr``: every chunk, even if one fails (the first is raised)."""
        with self._lock:
            registration = self._registrations.pop(ptr, None)
            if registration is None:
                raise KeyError(f"no host range registered at {ptr:#x}")
            with self._bounce_lock:
                self._bounced.pop(ptr, None)
            self._unregister_chunks(list(registration.chunks), quiet=False)

    def registered_ranges(self) -> list[HostRegistration]:
        """The live registrations, in order (dead host buffers released first)."""
        release_host_buffers()
        with self._lock:
            return list(self._registrations.values())

    def _unregister_chunks(self, chunks: list[tuple[int, int]], *, quiet: bool) -> None:
        first: HostRegistrationError | None = None
        for chunk_ptr, chunk_size in chunks:
            rc = self._unregister_chunk(chunk_ptr)
            if rc != 0 and first is None:
                first = self._error("unregister", chunk_ptr, chunk_size, rc)
        if first is not None:
            if not quiet:
                raise first
            # Rolling back after a failed register: the register error is the one to report.
            logger.error("%s", first)

    def _error(self, action: str, ptr: int, nbytes: int, rc: int, context: str = "") -> HostRegistrationError:
        return HostRegistrationError(
            f"{self.type} host {action} of chunk [{ptr:#x}, {ptr + nbytes:#x}) ({nbytes} bytes) failed "
            f"with return code {rc} ({self._describe_return_code(rc)}){context}",
            return_code=rc, ptr=ptr, nbytes=nbytes)

    def _register_chunk(self, ptr: int, nbytes: int) -> int:
        """Register one page-aligned chunk; return the runtime's code (0 = success)."""
        calls = self._vendor_calls()
        return calls[0](ptr, nbytes) if calls else 0

    def _unregister_chunk(self, ptr: int) -> int:
        """Unregister one chunk; return the runtime's code (0 = success)."""
        calls = self._vendor_calls()
        return calls[1](ptr) if calls else 0

    def _vendor_calls(self) -> tuple[Any, Any] | None:
        if self.type == "npu":
            # ACL calls act on the calling thread's context; torch_npu creates it lazily.
            module = self._accel()
            module.set_device(module.current_device())
        return _HOST_REGISTER_CALLS.get(self.type)

    def _describe_return_code(self, rc: int) -> str:
        if self.type == "cuda":
            return _cuda_error_string(rc)
        return "aclError; see the CANN error code list" if self.type == "npu" else "no-op backend"


_HOST_REGISTER_CALLS = {
    "cuda": (_cuda_host_register, _cuda_host_unregister),
    "npu": (_acl_host_register, _acl_host_unregister)}


# -- selection ------------------------------------------------------------------------------------
def _import_torch_npu() -> ModuleType:
    importlib.import_module("torch_npu")
    return cast(ModuleType, torch.npu)  # type: ignore[attr-defined]


def _available(device_type: DeviceType) -> bool:
    if device_type == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            return bool(_import_torch_npu().is_available())
        except Exception as exc:  # a broken CANN install must not hide CUDA or CPU
            logger.warning("torch_npu is installed but unusable: %s", exc)
            return False
    if device_type == "cuda":
        return torch.cuda.is_available()
    return True


def select_device_type() -> DeviceType:
    """The backend this process uses: ``$SWAP_STATE_DEVICE`` if set, else NPU, CUDA, CPU."""
    forced = os.environ.get(DEVICE_ENV_VAR, "").strip().lower()
    if forced:
        if forced not in _DEVICE_TYPES:
            raise ValueError(f"{DEVICE_ENV_VAR}={forced!r}: expected one of {', '.join(_DEVICE_TYPES)}")
        device_type = cast(DeviceType, forced)
        if not _available(device_type):
            raise RuntimeError(f"{DEVICE_ENV_VAR}={forced} but no {forced} device is available in this process")
        return device_type
    return next(device_type for device_type in _DEVICE_TYPES if _available(device_type))  # "cpu" at last


_BACKEND: DeviceBackend | None = None
_BACKEND_LOCK = threading.Lock()


def get_device_backend(*, refresh: bool = False) -> DeviceBackend:
    """The process-wide backend, chosen on first call (``refresh=True`` chooses again)."""
    global _BACKEND
    with _BACKEND_LOCK:
        if _BACKEND is None or refresh:
            _BACKEND = DeviceBackend(select_device_type())
            logger.info("swap-state device backend: %s", _BACKEND.type)
        return _BACKEND


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, not copied, for a hash (``tensor.numpy()`` would
    need numpy, which a plain trainer need not have). The tensor must outlive the view."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("host_bytes needs a contiguous CPU tensor")
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr()))
