"""CallBatcher (runtime/batcher.py): a burst of submissions goes out in few calls, in order, errors reach their
submitters, and a lone submission is sent at once."""

from __future__ import annotations

import asyncio

import pytest

from mtp_ray.runtime.batcher import CallBatcher


def test_burst_is_batched_in_order_and_a_lone_item_goes_at_once():
    async def main():
        calls: list[list[int]] = []

        async def send(items):
            calls.append(list(items))
            await asyncio.sleep(0.01)  # the call in flight: what arrives meanwhile waits for the next one

        b = CallBatcher(send)
        await b.submit(-1)
        assert calls == [[-1]]
        await asyncio.gather(*[b.submit(i) for i in range(100)])
        return calls

    calls = asyncio.run(main())
    assert [x for c in calls[1:] for x in c] == list(range(100))
    assert len(calls) <= 3  # the first item alone, then everything that queued behind it


def test_a_failed_call_fails_its_items_and_later_items_still_go():
    async def main():
        sent: list[list[str]] = []

        async def send(items):
            sent.append(list(items))
            await asyncio.sleep(0.01)
            if "bad" in items:
                raise RuntimeError("rank gone")

        b = CallBatcher(send)
        first = asyncio.gather(b.submit("bad"), return_exceptions=True)
        await asyncio.sleep(0)  # "bad" is in flight alone
        later = asyncio.gather(b.submit("x"), b.submit("y"))
        res = await first
        await later
        return res, sent, b

    res, sent, b = asyncio.run(main())
    assert isinstance(res[0], RuntimeError) and "rank gone" in str(res[0])
    assert sent == [["bad"], ["x", "y"]] and not b.busy and b.calls == 2


def test_submit_raises_the_calls_error():
    async def main():
        async def send(items):
            raise ValueError("nope")

        await CallBatcher(send).submit(1)

    with pytest.raises(ValueError, match="nope"):
        asyncio.run(main())
