"""Where the group's poll loop puts a request's outputs: streamed per step (StreamSink) or collected (Collector);
the rank -> group wire format they come through."""

import asyncio

import pytest

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.runtime.messages import RequestError, pack_step, unpack_step
from mtp_ray.runtime.sinks import Collector, StreamSink


def wire(steps: list[StepOutput]) -> list[StepOutput]:
    """The outputs as the group receives them: packed by a rank, one message per step, and unpacked."""
    return [o for s in steps for o in unpack_step(pack_step(0, [s]))[1]]


def test_wire_round_trip_keeps_every_field_typed():
    outs = [StepOutput("a", [5, 6], [-0.5, -0.25], [{5: -0.5, 9: -1.5}, {}], False),
            StepOutput("b", [], [], [], True, "error", error="prompt must not be empty"),
            StepOutput("c", [7], [-1.0], [{}], True, "stop", 7, 3, {"num_drafts": 2})]
    step, got = unpack_step(pack_step(42, outs))
    assert step == 42 and got == outs and all(isinstance(o, StepOutput) for o in got)
    assert list(got[0].new_top_logprobs[0]) == [5, 9]  # int token ids, in order
    assert issubclass(RequestError, ValueError)  # a refused request is the caller's error (HTTP 400)


def test_collector_appends_rows_and_resolves_once_finished():
    async def go():
        c = Collector()
        for out in wire([StepOutput("a", [5, 6], [-0.5, -0.25], [{}, {}], False),
                         StepOutput("a", [7], [-1.0], [{}], True, "stop", 7, 3, {"num_drafts": 2})]):
            assert not c.done.done()
            c.put(out)
        await c.done
        return c

    c = asyncio.run(go())
    assert c.token_ids == [5, 6, 7] and c.log_probs == [-0.5, -0.25, -1.0]
    assert (c.last.finish_reason, c.last.stop_reason, c.last.spec) == ("stop", 7, {"num_drafts": 2})


def test_collector_fail_raises_in_the_waiter_once():
    async def go():
        c = Collector()
        c.fail(RuntimeError("group failed"))
        c.fail(RuntimeError("second"))  # ignored: the first error ends the request
        await c.done

    with pytest.raises(RuntimeError, match="group failed"):
        asyncio.run(go())


def test_stream_sink_yields_step_outputs_with_top_logprobs():
    async def go():
        s = StreamSink()
        out = StepOutput("b", [3], [-0.1], [{3: -0.1, 9: -2.5}], True, "length", None, 4, {})
        for o in wire([out]):
            s.put(o)
        return await s.queue.get(), out

    got, sent = asyncio.run(go())
    assert got == sent


def _ready_group():
    """An EngineGroup with no ranks, ready, whose requests go nowhere: rows are fed to its sinks by hand."""
    from mtp_ray.config.engine import EngineConfig
    from mtp_ray.runtime.batcher import CallBatcher
    from mtp_ray.runtime.group import EngineGroup

    g = EngineGroup(EngineConfig.from_dict({"device": "cpu", "parallel": {"dp": 1}}))
    g.state, g.max_model_len = "ready", 64

    async def send(items):
        pass

    g.adds = [CallBatcher(send)]
    g.ready.set()
    return g


def test_stream_coalesces_what_arrived_while_its_consumer_was_away():
    """EngineGroup.generate: deltas queued behind the one being taken leave as one (a slow Serve stream gets fewer,
    larger items); a failure queued behind deltas is raised after they went out."""
    from mtp_ray.engine.sampling_params import SamplingParams

    async def go(fail: bool):
        g = _ready_group()
        gen = g.generate([1, 2, 3], SamplingParams(max_tokens=4), request_id="r")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        sink = g.reqs["r"][1]
        for i in range(3):
            sink.put(wire([StepOutput("r", [10 + i], [-0.1 * i], [{}], False)])[0])
        if fail:
            sink.fail(RuntimeError("group failed"))
        else:
            sink.put(wire([StepOutput("r", [13], [-0.3], [{}], True, "length", None, 3, {"x": 1})])[0])
        got = [await first]
        try:
            async for out in gen:
                got.append(out)
        except RuntimeError as e:
            got.append(e)
        assert "r" not in g.reqs  # released either way
        return got

    (one,) = asyncio.run(go(False))
    assert one.new_token_ids == [10, 11, 12, 13] and one.finished and one.finish_reason == "length"
    assert one.new_logprobs == [0.0, -0.1, -0.2, -0.3] and one.spec == {"x": 1}
    deltas, err = asyncio.run(go(True))
    assert deltas.new_token_ids == [10, 11, 12] and not deltas.finished and "group failed" in str(err)
