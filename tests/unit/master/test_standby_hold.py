"""The standby hold (master.service.waiting.StandbyHold): held calls end together when the master leads, or
each after the hold."""

from __future__ import annotations

import asyncio

from master.service.waiting import HOLD_CAP_S, StandbyHold, hold_seconds


async def _settle() -> None:
    for _ in range(5):  # let every task started so far run up to its await
        await asyncio.sleep(0)


def test_the_hold_is_a_quarter_of_the_heartbeat_timeout_and_at_most_the_cap():
    assert hold_seconds(2.0) == 0.5
    assert hold_seconds(4.0) == HOLD_CAP_S
    assert hold_seconds(60.0) == HOLD_CAP_S


def test_leading_releases_every_held_call_at_once_and_later_calls_pass():
    async def scenario() -> tuple[int, int, bool]:
        hold = StandbyHold(30.0)
        held = [asyncio.ensure_future(hold.wait()) for _ in range(3)]
        await _settle()
        waiting_before = hold.waiting
        assert not any(task.done() for task in held)
        hold.led()
        await asyncio.wait_for(asyncio.gather(*held), 5.0)
        passes = asyncio.ensure_future(hold.wait())
        await _settle()
        return waiting_before, hold.waiting, passes.done()

    assert asyncio.run(scenario()) == (3, 0, True)


def test_a_standby_ends_each_hold_after_its_seconds_and_holds_again_after_losing():
    async def scenario() -> tuple[bool, int]:
        hold = StandbyHold(0.05)
        await asyncio.wait_for(hold.wait(), 5.0)  # nobody leads: the hold ends by itself
        hold.led()
        hold.lost()
        again = asyncio.ensure_future(hold.wait())
        await _settle()
        held_again = not again.done()
        await asyncio.wait_for(again, 5.0)
        return held_again, hold.waiting

    assert asyncio.run(scenario()) == (True, 0)
