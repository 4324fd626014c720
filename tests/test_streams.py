"""The direct streams (docs/design.md, "Streams"): a rank's outboxes (which reader gets which step output, the
group's end notices, dropping a subscriber that stopped pulling) and an ingress replica's deliveries (one pull loop
per rank, outputs merged per pull, a dead rank ending its requests). Pure Python and asyncio, no Ray."""

import asyncio
import threading
import time

import pytest

from mtp_ray.engine.outputs import StepOutput
from mtp_ray.runtime.group_monitor import GroupFailed
from mtp_ray.runtime.messages import Admission, unpack_step
from mtp_ray.runtime.outboxes import GROUP, Outboxes
from mtp_ray.serve.cluster.delivery import Deliveries


def out(rid: str, toks: list[int], done: bool = False) -> StepOutput:
    return StepOutput(rid, toks, [-0.1] * len(toks), [{}] * len(toks), done, "length" if done else None)


def rows(msgs: list[bytes]) -> list[StepOutput]:
    return [o for m in msgs for o in unpack_step(m)[1]]


def never() -> bool:
    return False


def test_outboxes_route_each_output_to_its_reader_and_tell_the_group_of_ends():
    box = Outboxes()
    box.route("a", "ing1")
    box.route("b", "ing2")
    box.route("g", GROUP)  # the group's own request (rollout handle)
    box.publish(1, [out("a", [5]), out("b", [6]), out("g", [7])])
    box.publish(2, [out("a", [8], done=True), out("g", [9])])
    assert rows(box.take("ing1", 0, never)) == [out("a", [5]), out("a", [8], done=True)]
    assert rows(box.take("ing2", 0, never)) == [out("b", [6])]
    group = rows(box.take(GROUP, 0, never))
    # the group gets its own request's outputs, and a bare end notice for the subscriber's request that finished
    assert group == [out("g", [7]), StepOutput("a", [], [], [], True, "length"), out("g", [9])]
    assert box.subscribers() == {"ing1": 0, "ing2": 1}
    assert box.take("ing1", 0, never) == []  # taken once


def test_outboxes_long_poll_waits_for_the_first_message():
    box = Outboxes()
    box.route("a", "ing")
    threading.Timer(0.05, lambda: box.publish(1, [out("a", [1])])).start()
    t0 = time.monotonic()
    assert rows(box.take("ing", 5.0, never)) == [out("a", [1])]
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert box.take("ing", 0.05, never) == [] and time.monotonic() - t0 >= 0.04  # nothing: back after the timeout


def test_a_subscriber_that_stops_pulling_is_dropped_and_its_requests_returned_for_abort():
    box = Outboxes(expire_s=0.05)
    box.route("a", "gone")
    box.route("b", "live")
    box.route("c", "gone")
    time.sleep(0.1)
    box.take("live", 0, never)  # pulled: stays
    assert sorted(box.expire()) == ["a", "c"]
    assert box.subscribers() == {"live": 1}
    # the aborts' outputs: dropped for the gone reader, the group still hears the requests ended
    box.publish(3, [StepOutput("a", [], [], [], True, "abort"), out("b", [4])])
    assert [o.request_id for o in rows(box.take(GROUP, 0, never))] == ["a"]
    assert rows(box.take("live", 0, never)) == [out("b", [4])]


def test_a_new_request_keeps_its_idle_subscriber():
    """A subscriber idle here for nearly expire_s sends a new request: it is not dropped (with the request aborted)
    before its first pull for it."""
    box = Outboxes(expire_s=0.2)
    box.route("a", "ing")
    box.take("ing", 0, never)
    box.publish(1, [StepOutput("a", [5], [0.0], [], True, "length")])  # its only request ended
    box.take("ing", 0, never)
    time.sleep(0.15)
    box.route("b", "ing")  # a new one, 0.15 s after its last pull
    time.sleep(0.1)
    assert box.expire() == [] and box.subscribers() == {"ing": 1}


class FakeRank:
    """A rank actor's `pull` as Ray's handle offers it (`worker.pull.remote(...)` is awaitable)."""

    def __init__(self, box: Outboxes):
        self.box = box
        self.error: str | None = None
        self.dead = False
        self.pull = self

    def remote(self, subscriber: str, timeout: float):
        async def call():
            if self.dead:
                raise RuntimeError("The actor died unexpectedly before finishing this task.")
            msgs = await asyncio.to_thread(self.box.take, subscriber, min(timeout, 0.05), lambda: bool(self.error))
            return {"rank": 0, "msgs": msgs, "error": self.error, "stopped": False}
        return call()


def test_deliveries_merge_each_pull_per_request_and_end_requests_of_a_dead_rank():
    async def go():
        d = Deliveries()
        box = Outboxes()
        rank = FakeRank(box)
        qa, qb = d.expect("a"), d.expect("b")
        for rid in ("a", "b"):
            box.route(rid, d.subscriber)
        # three steps before the first pull: one delta per request
        for s, toks in enumerate(([1], [2, 3], [4])):
            box.publish(s, [out("a", toks), out("b", [10 + s])])
        d.attach(Admission("a", "g1", 1, 0, rank))
        d.attach(Admission("b", "g1", 1, 0, rank))
        got = await asyncio.wait_for(qa.get(), 5)
        assert got.new_token_ids == [1, 2, 3, 4] and (await qb.get()).new_token_ids == [10, 11, 12]
        assert len(d.loops) == 1  # one pull loop for the rank, whatever the requests on it
        box.publish(4, [out("a", [5], done=True)])
        assert (await asyncio.wait_for(qa.get(), 5)).finished
        d.drop("a")
        rank.dead = True  # the rank dies: the request still on it ends with GroupFailed (sent again if no tokens)
        err = await asyncio.wait_for(qb.get(), 5)
        assert isinstance(err, GroupFailed) and "rank 0 of engine group g1 is gone" in str(err)
        await asyncio.sleep(0.01)
        assert d.loops == {} and d.by_source == {}

    asyncio.run(go())


def test_a_rank_gone_with_its_stopped_group_reads_as_the_stop():
    """A rank killed with the group replica Serve stopped (Ray: its owner's exit was intended) reads as that stop,
    with the setting that bounds it; the pull in flight may fail before Ray has the cause (no "because"), so a
    later call is asked (a crash still reads as a rank gone)."""
    from ray.exceptions import RayActorError

    from mtp_ray.serve.cluster.delivery import rank_gone, settled

    class Died(RayActorError):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

        def __str__(self) -> str:
            return self.text

    head = "The actor died unexpectedly before finishing this task."
    stopped = Died(f"{head}\nThe actor is dead because its owner has died. Owner worker exit type: "
                   "INTENDED_SYSTEM_EXIT Worker exit detail: Owner's worker process has crashed.")

    class Worker:
        calls = 0

        class __ray_ready__:  # noqa: N801 (the actor method's name)
            @staticmethod
            def remote():
                Worker.calls += 1

                async def fail():
                    raise stopped if Worker.calls > 1 else Died(head)
                return fail()

    later = asyncio.run(settled(Worker, Died(head)))
    assert later is stopped and Worker.calls == 2
    msg = rank_gone(0, "g1", later)
    assert "engine group g1 was stopped before this request ended" in msg and "graceful_shutdown_timeout_s" in msg
    crash = Died(f"{head}\nThe actor is dead because its owner has died. Owner worker exit type: SYSTEM_ERROR")
    assert rank_gone(1, "g1", crash).startswith("rank 1 of engine group g1 is gone (the group replica that owns")
    assert rank_gone(1, "g1", ValueError("x")) == "rank 1 of engine group g1 is gone: ValueError: x"


def test_the_long_polls_leave_no_task_record_in_the_gcs():
    """pull, poll and the metrics reports run several times a second per rank and replica: Ray's per-call task
    records made the GCS grow ~30 MB per 1,000 requests in a soak (77 % of the records were these)."""
    from mtp_ray.runtime.worker import RankWorker
    from mtp_ray.serve.cluster.metrics_hub import MetricsHub

    for method in (RankWorker.pull, RankWorker.poll, MetricsHub.report):
        assert method.__ray_enable_task_events__ is False, method


def test_pulls_are_spaced_by_the_stream_interval_only_for_many_streams():
    """A rank stepping every 5 ms: with SPACED_STREAMS streams on it the replica pulls at most once per interval
    (each pull bringing the steps since the last, as larger deltas), with fewer it pulls after every step; no token
    is lost either way."""
    from mtp_ray.serve.cluster.delivery import SPACED_STREAMS

    async def run(streams: int, interval: float) -> tuple[int, list[int]]:
        d, box = Deliveries(interval), Outboxes()
        rank = FakeRank(box)
        rids = [f"r{i}" for i in range(streams)]
        queues = [d.expect(r) for r in rids]
        for r in rids:
            box.route(r, d.subscriber)
            d.attach(Admission(r, "g1", 1, 0, rank))
        for step in range(40):
            box.publish(step, [out(r, [step], done=step == 39) for r in rids])
            await asyncio.sleep(0.005)
        tokens = []
        for q in queues:
            got: list[int] = []
            finished = False
            while not finished:
                item = await asyncio.wait_for(q.get(), 5)
                got, finished = got + item.new_token_ids, item.finished
            tokens.append(len(got))
        return d.pulls, tokens

    spaced, toks = asyncio.run(run(SPACED_STREAMS, 0.05))
    assert toks == [40] * SPACED_STREAMS and spaced <= 8, spaced  # 0.2 s of steps: ~5 pulls, not ~40
    every, toks = asyncio.run(run(SPACED_STREAMS - 1, 0.05))
    assert toks == [40] * (SPACED_STREAMS - 1) and every >= 16, every


def test_deliveries_end_requests_with_the_ranks_error():
    async def go():
        d = Deliveries()
        box = Outboxes()
        rank = FakeRank(box)
        q = d.expect("a")
        d.attach(Admission("a", "g1", 1, 0, rank))
        rank.error = "rank 0 failed at wave 3 step 17: TimeoutError: collective timed out\nrank 0 last DPMeta: ..."
        err = await asyncio.wait_for(q.get(), 5)
        assert isinstance(err, GroupFailed) and "collective timed out" in str(err) and "DPMeta" not in str(err)

    asyncio.run(go())


@pytest.mark.parametrize("k", [0, 2])
def test_warmup_serves_a_workload_and_leaves_nothing_behind(k):
    """The warmup's synthetic workload (engine/warmup.py) ran to its end: every block and state slot back in the
    pool, no request left, the counters at zero for serving, and the engine serves as before."""
    from mtp_ray import LLM, SamplingParams

    llm = LLM(num_speculative_tokens=k)
    core = llm.engine
    assert not core.requests and not core.has_unfinished()
    assert core.blocks.num_free_blocks == core.blocks.num_blocks - 1  # block 0 is reserved
    assert core.stats.steps == 0 and core.stats.output_tokens == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5 and core.stats.output_tokens == 5


def test_a_step_wakes_only_its_readers():
    """A subscriber's tokens wake that subscriber's pull, not the group's poll; the group's end notice waits for
    its poll's timeout. A failing rank (stop condition + wake_all) returns every waiting pull at once."""
    box = Outboxes()
    box.route("a", "ing")
    got: dict[str, tuple[float, list]] = {}

    def wait(name: str, timeout: float, stop=never) -> None:
        t0 = time.monotonic()
        msgs = box.take(name, timeout, stop)
        got[name] = (time.monotonic() - t0, rows(msgs))

    threads = [threading.Thread(target=wait, args=("ing", 5.0)), threading.Thread(target=wait, args=(GROUP, 0.5))]
    for t in threads:
        t.start()
    time.sleep(0.05)
    box.publish(1, [out("a", [1], done=True)])
    for t in threads:
        t.join()
    assert got["ing"][0] < 0.3 and got["ing"][1] == [out("a", [1], done=True)]
    assert got[GROUP][0] >= 0.4 and got[GROUP][1] == [StepOutput("a", [], [], [], True, "length")]
    failed = threading.Event()
    t = threading.Thread(target=wait, args=("ing", 10.0, failed.is_set))
    t.start()
    time.sleep(0.05)
    failed.set()
    box.wake_all()
    t.join(2.0)
    assert not t.is_alive() and got["ing"][1] == []


def test_stream_interval_is_checked_by_name():
    from mtp_ray.config.server import ServerConfig

    assert ServerConfig.from_dict({"stream_interval_ms": 0}).stream_interval_ms == 0
    assert ServerConfig().stream_interval_ms == 5.0
    for bad in (-1, "5", True, 1e6):
        with pytest.raises(ValueError, match="server.stream_interval_ms"):
            ServerConfig.from_dict({"stream_interval_ms": bad})
    for name in ("enable_force_include_usage", "enable_prompt_tokens_details", "return_tokens_as_token_ids"):  # vLLM's
        assert getattr(ServerConfig(), name) is False and getattr(ServerConfig.from_dict({name: True}), name) is True
        with pytest.raises(ValueError, match=f"server.{name} must be true or false"):
            ServerConfig.from_dict({name: "yes"})
