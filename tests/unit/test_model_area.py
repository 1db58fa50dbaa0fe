"""The model area (client/model_area.py) on its own: which tensors a whole-state snapshot holds,
and the order of copy, event and ``MODEL_STEP`` on an accelerator, played by a fake backend
whose events complete only when the test says so (no device here; the real streams run in
the CUDA tests)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
from fake_async_device import AsyncFakeBackend

from swap_state.client.remote.model_area import ModelArea, plan_model_tensors
from swap_state.common.segment import SegmentHeader, Word
from swap_state.common.trainer_header import TrainerHeader


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_tied_weights_once_with_aliases_and_persistent_buffers_only():
    model = Tied()
    planned = {t.fqn: t for t in plan_model_tensors([model], list(model.parameters()))}
    assert sorted(planned) == ["embed.weight", "scale"]
    assert planned["embed.weight"].aliases == ("head.weight",)
    assert planned["embed.weight"].key == "param" and planned["scale"].key == "buffer"
    assert planned["embed.weight"].source is model.embed.weight  # the live parameter
    assert planned["embed.weight"].spec() == ("model.embed.weight", "float32", [6, 4])


def test_a_non_tensor_state_entry_is_refused_by_name():
    class Extra(nn.Linear):
        def get_extra_state(self):
            return {"note": 1}

        def set_extra_state(self, state):
            pass

    with pytest.raises(ValueError, match=r"'_extra_state' is a dict.*'full' checkpoint mode"):
        plan_model_tensors([Extra(2, 2)])


class _Event:
    def __init__(self):
        self.landed = threading.Event()
        self.waited_by: list[object] = []

    def record(self, stream=None):
        pass

    def synchronize(self):
        assert self.landed.wait(10)


class _Stream:
    def __init__(self):
        self.waited: list[object] = []

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        self.waited.append(event)


class FakeAccelerator:
    """Asynchronous as far as the area can tell: events land when the test sets them."""

    is_accelerator = True

    def __init__(self):
        self.compute = _Stream()
        self.events: list[_Event] = []
        self.copies: list[tuple[str, torch.Tensor]] = []  # (direction, host tensor)

    def copy_to_host(self, dst, src):
        self.copies.append(("to_host", dst))
        dst.copy_(src)

    def copy_to_device(self, dst, src):
        self.copies.append(("to_device", src))
        dst.copy_(src)

    def current_device(self):
        return torch.device("cpu")

    def set_device(self, device):
        pass

    def stream(self):
        return _Stream()

    def current_stream(self):
        return self.compute

    def event(self, *, blocking=False):
        self.events.append(_Event())
        return self.events[-1]

    def use_stream(self, stream):
        return contextlib.nullcontext(stream)

    def synchronize(self):
        pass


class FakeGuard:
    def __init__(self):
        self.protected: list[list[str]] = []

    def protect(self, names):
        self.protected.append(list(names))


def _area(model, backend, header):
    tensors = plan_model_tensors([model], list(model.parameters()))
    views = {t.name: torch.zeros_like(t.local) for t in tensors}
    return ModelArea(tensors, views, FakeGuard(), TrainerHeader(header), backend), views


def test_accelerator_copy_publishes_only_after_its_event_and_the_next_update_waits_for_it():
    model = nn.Linear(3, 2)
    backend = FakeAccelerator()
    header = SegmentHeader(bytearray(4096), n_chunks=0, cow_slots=0)
    header[Word.MODEL_STEP] = 5  # step 4's parameters were copied before
    area, views = _area(model, backend, header)
    area.copy_from_model(5)
    assert area._guard.protected == [["model.weight", "model.bias"]]  # before the copy
    assert header[Word.MODEL_STEP] == 5  # not withdrawn: not a claim for step 5 or later
    backend.events[0].landed.set()
    area.wait_published()
    assert header[Word.MODEL_STEP] == 6
    assert torch.equal(views["model.weight"], model.weight.detach())
    area.wait_copy()  # the next optimizer step's compute stream waits for the copy
    assert backend.compute.waited == [backend.events[0]]
    # Through the backend (its bounce ring where registered memory is not honoured).
    assert [(d, t.data_ptr()) for d, t in backend.copies] == [
        ("to_host", views["model.weight"].data_ptr()), ("to_host", views["model.bias"].data_ptr())
    ]
    area.close()


def test_a_stale_claim_is_withdrawn_while_the_copy_is_in_flight():
    model = nn.Linear(3, 2)
    backend = FakeAccelerator()
    header = SegmentHeader(bytearray(4096), n_chunks=0, cow_slots=0)
    header[Word.MODEL_STEP] = 9  # bytes of before a load: they are not step 3's
    area, _ = _area(model, backend, header)
    area.copy_from_model(3)
    assert header[Word.MODEL_STEP] == 0
    backend.events[0].landed.set()
    area.close()  # waits for the publication
    assert header[Word.MODEL_STEP] == 4


def test_restore_copies_the_segment_into_the_model_and_claims_the_step():
    model = nn.Linear(3, 2)
    backend = FakeAccelerator()
    header = SegmentHeader(bytearray(4096), n_chunks=0, cow_slots=0)
    area, views = _area(model, backend, header)
    views["model.weight"].fill_(0.25)
    area.copy_into_model(7)
    assert torch.equal(model.weight.detach(), torch.full((2, 3), 0.25))
    assert [d for d, _ in backend.copies] == ["to_device", "to_device"]
    assert header[Word.MODEL_STEP] == 8 and area.copied_step == 7
    area.close()


def test_the_copy_builds_no_autograd_graph_into_the_segment():
    """torchtitan steps the optimizer with grad mode on: a copy of a parameter that requires
    grad must not make the segment view part of a graph (it would grow every step)."""
    from swap_state.client.device import DeviceBackend

    model = nn.Linear(3, 2)
    header = SegmentHeader(bytearray(4096), n_chunks=0, cow_slots=0)
    area, views = _area(model, DeviceBackend("cpu"), header)
    with torch.enable_grad():
        area.copy_from_model(1)
    area.wait_copy()  # the next update waits for the helper thread's copy
    assert not views["model.weight"].requires_grad and views["model.weight"].grad_fn is None
    assert header[Word.MODEL_STEP] == 2 and torch.equal(views["model.weight"], model.weight.detach())
    area.close()


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
def test_the_helper_thread_sets_the_device_and_waits_on_a_blocking_event(accelerator):
    """The helper thread's first act is to set the trainer's device (a no-op on CPU); on an
    accelerator it waits for the side-stream copy, which lands only when waited for, on a
    blocking event."""
    model = nn.Linear(3, 2)
    backend = AsyncFakeBackend(accelerator=accelerator)
    header = SegmentHeader(bytearray(4096), n_chunks=0, cow_slots=0)
    area, views = _area(model, backend, header)
    area.copy_from_model(1)
    area.wait_published()
    assert header[Word.MODEL_STEP] == 2 and torch.equal(views["model.weight"], model.weight.detach())
    assert backend.pending() == 0
    assert len(backend.set_device_calls) == 1
    thread, device = backend.set_device_calls[0]
    assert thread.startswith("swap-state-model") and device == backend.current_device()
    assert backend.event_kwargs == ([{"blocking": True}] if accelerator else [])
    area.copy_from_model(2)  # the same thread: the device is set once
    area.close()
    assert len(backend.set_device_calls) == 1 and header[Word.MODEL_STEP] == 3
