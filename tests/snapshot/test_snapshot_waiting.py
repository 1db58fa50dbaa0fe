"""WatchedCondition and Latch: coroutines await what threads change, holding no thread."""

from __future__ import annotations

import asyncio
import threading

from swap_state.server.snapshot.waiting import Latch, WatchedCondition


def test_a_hundred_coroutines_wait_on_a_latch_that_a_thread_sets_holding_no_thread():
    latch = Latch()

    async def main() -> list[bool]:
        waiters = [asyncio.ensure_future(latch.wait_async(30)) for _ in range(100)]
        await asyncio.sleep(0)  # all are waiting now
        threads_while_waiting = set(threading.enumerate())  # a set: an earlier test's thread may end meanwhile
        setter = threading.Thread(target=latch.set)
        setter.start()
        results = await asyncio.gather(*waiters)
        setter.join()
        assert set(threading.enumerate()) <= threads_while_waiting
        return results

    before = set(threading.enumerate())
    assert asyncio.run(main()) == [True] * 100
    assert set(threading.enumerate()) <= before and latch.wait(0) and latch.is_set()


def test_until_checks_its_predicate_at_each_notify_and_times_out_false():
    cond = WatchedCondition()
    state = {"n": 0}

    def bump_to(n: int) -> None:
        for _ in range(n):
            with cond:
                state["n"] += 1
                cond.notify_all()

    async def main() -> tuple[bool, bool, bool]:
        reached = asyncio.ensure_future(cond.until(lambda: state["n"] >= 3, 30))
        never = asyncio.ensure_future(cond.until(lambda: state["n"] >= 100, 0.05))
        await asyncio.sleep(0)
        thread = threading.Thread(target=bump_to, args=(3,))
        thread.start()
        results = await reached, await never, await cond.until(lambda: True, 0)
        thread.join()
        return results

    assert asyncio.run(main()) == (True, False, True)
    assert cond._watchers == []  # nothing left behind by a timeout
