"""The one wait-and-retry helper: ready at once, ready later with backoff, a deadline, abort."""

from __future__ import annotations

import pytest

from swap_state.common.retry import wait_until


def test_ready_at_once_does_not_sleep():
    naps = []
    assert wait_until(lambda: True, timeout_s=0, sleep=naps.append) is True
    assert naps == []


def test_backs_off_doubling_up_to_the_cap():
    calls = iter([False] * 6 + [True])
    naps = []
    assert wait_until(lambda: next(calls), timeout_s=None, first_s=0.001, max_s=0.004, sleep=naps.append)
    assert naps == [0.001, 0.002, 0.004, 0.004, 0.004, 0.004]


def test_a_deadline_ends_the_wait_with_false():
    assert wait_until(lambda: False, timeout_s=0.05, first_s=0.01, max_s=0.01) is False


def test_a_sleep_that_raises_aborts_the_wait():
    class Cancelled(Exception):
        pass

    def nap(_seconds):
        raise Cancelled()

    with pytest.raises(Cancelled):
        wait_until(lambda: False, timeout_s=10, sleep=nap)
