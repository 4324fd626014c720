"""Scheduler and block manager: pure Python, no model."""

from __future__ import annotations

import random

from mtp_ray.config.engine import SchedulerConfig
from mtp_ray.engine.block_manager import BlockManager
from mtp_ray.engine.request import Request, Status
from mtp_ray.engine.sampling_params import SamplingParams
from mtp_ray.engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, k=0, **cfg) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, 1 + 8 * (2 + k), 1 + (k + 1 if k else 0))
    return Scheduler(SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 16, "prefill_chunk": 8, **cfg}),
                     bm, lookahead=k)


def req(i: int, n: int) -> Request:
    return Request(str(i), list(range(1, n + 1)), SamplingParams())


def run_step(s: Scheduler, turn: bool | None = None) -> list:
    """Pretend the model ran: commit scheduled tokens; completed prefills / decodes emit one token. turn: the
    split-scheduling turn a DP group agreed on (None: the scheduler alternates alone)."""
    out = s.schedule(turn)
    for sc in out:
        if sc.verify:  # every draft rejected: the target's token is committed
            sc.req.num_computed += 1
            sc.req.drafts = []
            sc.req.output_ids.append(7)
            continue
        done = sc.completes_prefill
        sc.req.num_computed += sc.num_new
        if done:
            sc.req.output_ids.append(7)
    return out


def test_chunked_prefill_respects_budget_and_chunk():
    s = make()
    s.add(req(0, 20))
    s.add(req(1, 3))
    first = run_step(s)
    assert [(x.req.request_id, x.num_new) for x in first] == [("0", 8), ("1", 3)]
    second = run_step(s)
    # request 1 decodes (1 token), request 0 continues its prefill
    assert sorted((x.req.request_id, x.num_new) for x in second) == [("0", 8), ("1", 1)]
    assert sum(x.num_new for x in second) <= 16


def test_fcfs_admission_and_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(i, 2))
    out = run_step(s)
    assert [x.req.request_id for x in out] == ["0", "1"] and len(s.waiting) == 2


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=9, block_size=4, max_num_batched_tokens=64, prefill_chunk=64)
    a, b = req(0, 12), req(1, 12)
    s.add(a)
    s.add(b)
    run_step(s)  # 3 + 3 blocks of the 8 usable; then both decode until blocks run out
    for _ in range(12):
        run_step(s)
        s.blocks.check(s.running)
    assert s.num_preemptions > 0
    victim = b if b.num_preemptions else a
    assert victim.num_preemptions > 0 and victim.output_ids  # tokens kept for recompute


def test_preempted_request_keeps_drafts_and_recomputes_up_to_its_verify():
    """Recompute preemption keeps the drafts: the re-prefill stops before the newest token (nothing sampled), then
    the newest token and the drafts are one verify, as if the cache had never been dropped."""
    s = make(k=2, max_num_batched_tokens=64, prefill_chunk=8)
    r = req(0, 10)
    s.add(r)
    run_step(s)
    run_step(s)  # prefill in two pieces of 8 and 2: one output token
    r.drafts = [5, 6]
    s._preempt(r)
    assert r.drafts == [5, 6] and r.num_computed == 0 and r.status is Status.WAITING
    pieces = []
    while not (out := s.schedule()) or not out[0].verify:
        assert not out[0].completes_prefill  # the recompute never samples
        pieces.append(out[0].num_new)
        r.num_computed += out[0].num_new
    assert pieces == [8, 2] and r.num_computed == r.num_tokens - 1 == 10
    assert out[0].num_new == 3  # the newest token + 2 drafts


def test_cache_hit_of_a_preempted_request_schedules_its_verify():
    """A recompute whose prefix-cache hit reaches its newest token is admitted straight into its verify."""
    bm = BlockManager(64, 4, 1 + 8 * 4 + 2, 1 + 3, snapshot_slots=2, lookahead=1)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=64), bm, lookahead=2)
    r = req(0, 8)
    s.add(r)
    run_step(s)  # 8 prompt tokens + 1 output: its first 8 tokens (2 blocks) can be named now
    assert len(bm.prefix_hashes(r)) == 2 and bm.publish(r, 8) is not None
    r.drafts = [5, 6]
    s._preempt(r)
    out = s.schedule()
    assert out[0].req is r and r.num_cached_tokens == 8 and out[0].verify and out[0].num_new == 3


def test_verify_cost_and_lookahead_blocks():
    s = make(k=3, max_num_batched_tokens=64)
    r = req(0, 5)
    s.add(r)
    run_step(s)
    r.drafts = [1, 2, 3]
    out = s.schedule()
    assert out[0].verify and out[0].num_new == 4
    # blocks cover num_computed + (k + 1) + k lookahead positions
    assert len(r.block_ids) * 4 >= r.num_computed + 4 + 3
    assert len(r.state_slots) == 1 + 4


def test_random_workload_keeps_block_invariants_and_finishes_everything():
    rng = random.Random(0)
    s = make(num_blocks=24, block_size=4, k=2, max_num_batched_tokens=24)
    live: list[Request] = []
    limit = {}
    for step in range(400):
        if step < 200 and rng.random() < 0.3:
            r = req(step, rng.randint(1, 30))
            limit[r.request_id] = rng.randint(3, 12)
            s.add(r)
            live.append(r)
        for sc in run_step(s):
            r = sc.req
            if len(r.output_ids) >= limit[r.request_id]:
                s.finish(r, "length")
            elif not r.is_prefill and rng.random() < 0.5:
                r.drafts = [1, 2]
        s.blocks.check([r for r in live if r.status is Status.RUNNING])
    assert all(r.status is Status.FINISHED for r in live) and len(live) > 40
    assert s.num_preemptions > 0
    assert s.blocks.num_free_blocks == 23


def test_request_token_slices_equal_all_ids():
    from mtp_ray.engine.request import Request
    from mtp_ray.engine.sampling_params import SamplingParams

    r = Request("r", [1, 2, 3, 4], SamplingParams())
    r.output_ids = [5, 6, 7]
    for a in range(8):
        for b in range(a, 9):
            assert r.tokens(a, b) == r.all_ids[a:b], (a, b)


def test_split_mode_never_mixes_and_alternates_with_decodes():
    """Split mode: a step is all prefill pieces or all decodes; while both wait they alternate (no decode waits
    more than one prefill step) and everything finishes."""
    s = make(k=0, max_num_seqs=4, max_num_batched_tokens=12, prefill_chunk=4)
    s.split = True
    rng = random.Random(3)
    for i in range(10):
        s.add(req(i, rng.randint(1, 11)))  # a 1-token prompt is a prefill, not a decode
    kinds, prefill_run = [], 0
    for _ in range(300):
        if not s.has_unfinished():
            break
        decodes_waiting = any(r.is_decode for r in s.running)
        out = s.schedule()
        assert out, "a step with work pending scheduled nothing"
        dec = {x.req.is_decode for x in out}
        assert len(dec) == 1, "a step mixed prefill pieces and decodes"
        kinds.append(dec.pop())
        prefill_run = prefill_run + 1 if (not kinds[-1] and decodes_waiting) else 0
        assert prefill_run <= 1, "decodes waited more than one prefill step"
        for x in out:
            done = x.completes_prefill
            x.req.num_computed += x.num_new
            if done:
                x.req.output_ids.append(7)
                if len(x.req.output_ids) >= 3:
                    s.finish(x.req, "length")
    assert not s.has_unfinished()
    assert True in kinds and False in kinds


def test_group_turns_are_a_function_of_the_gathered_table():
    """DP split scheduling: the next turn comes from the last gathered table (the same on every rank);
    alternates while prefill and decode work are both pending somewhere; None when nothing is pending."""
    from mtp_ray.parallel.dp_meta import DPMeta, Gathered

    def table(*pending):
        return Gathered(tuple(DPMeta(pending_prefill=p, pending_decode=d) for p, d in pending))

    assert table((0, 0), (0, 0)).next_prefill_turn(False) is None  # e.g. a wave start: each rank alone
    assert table((1, 0), (0, 0)).next_prefill_turn(True) is True  # only prefill work anywhere
    assert table((0, 1), (0, 1)).next_prefill_turn(False) is False  # only decodes
    mixed = table((1, 0), (0, 1))  # rank 0 prefills, rank 1 decodes: turns alternate group-wide
    assert mixed.next_prefill_turn(False) is True and mixed.next_prefill_turn(True) is False


def test_group_turn_overrides_the_local_alternation():
    s = make(k=0, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=8)
    s.split = True
    s.add(req(0, 3))
    run_step(s)  # prefill of request 0 (alone): it decodes from now on
    assert s.running[0].is_decode
    # a group prefill turn on a rank with no prefill work: it decodes (the group step is eager anyway)
    assert [x.req.request_id for x in run_step(s, True)] == ["0"]
    s.add(req(1, 5))
    # a group decode turn: the new request waits, the decode runs (the group's decode step stays uniform)
    assert [x.req.request_id for x in run_step(s, False)] == ["0"]
    assert [x.req.request_id for x in run_step(s, True)] == ["1"]
    s2 = make(k=0)
    s2.split = True
    s2.add(req(2, 4))
    assert run_step(s2, False) == []  # only prefill work and a decode turn: this rank idles one step


def test_uniform_inputs_are_views_of_one_packed_tensor():
    """build_uniform packs a graph step's inputs in uniform_layout order (one host -> device transfer), padded
    rows zero, snapshot slots present on graph steps."""
    import dataclasses

    import torch

    from mtp_ray.engine.inputs import build_uniform, target_pieces, uniform_layout

    s = make(k=2)
    for i in range(3):
        s.add(req(i, 3 + 4 * i))  # ragged block tables
    while any(r.num_computed < len(r.prompt_ids) for r in s.running) or len(s.running) < 3:
        run_step(s)
    for r in s.running:
        r.drafts = [11, 12]
    sched = s.schedule()
    assert sched and all(sc.verify for sc in sched)
    pieces = target_pieces(sched)
    inp = build_uniform(pieces, s.blocks, 3, size=4, width=6)
    lay = uniform_layout(4, 3, 6, spec=True)
    assert inp.packed is not None and inp.packed.numel() == lay.total
    v = lay.views(inp.packed)
    u = inp.batch.uniform
    assert u is not None and u.spec_slots is not None
    for name, t in [("ids", inp.input_ids), ("pos", inp.positions), ("slots", inp.batch.slot_mapping),
                    ("tables", inp.batch.block_tables), ("ctx", u.context_lens), ("state", u.state_slots),
                    ("spec", u.spec_slots)]:
        assert t.data_ptr() == v[name].data_ptr() and torch.equal(t, v[name]), name
    n = len(pieces)
    assert inp.input_ids[: 3 * n].tolist() == [x for p in pieces for x in p.tokens]
    assert inp.input_ids[3 * n :].eq(0).all() and u.context_lens[n:].eq(0).all() and u.spec_slots[n:].eq(0).all()
    assert u.spec_slots[:n].tolist() == [p.spec_slots for p in pieces]
    # live rows equal the per-sequence reference (BlockManager.slot_of); padded rows read positions 0..q-1
    assert len({len(p.req.block_ids) for p in pieces}) > 1  # ragged tables: the scatter puts each row's own blocks
    _check_rows(inp, pieces, s.blocks)
    assert inp.batch.block_tables[n:].eq(0).all()
    assert inp.positions[3 * n :].tolist() == [0, 1, 2] * (4 - n) and u.state_slots[:n].tolist() == [
        p.req.state_slots[0] for p in pieces]
    # an eager uniform batch (no size): no padding, tables as wide as the widest sequence
    eager = build_uniform(pieces, s.blocks, 3)
    width = max(len(p.req.block_ids) for p in pieces)
    assert eager.packed is not None and eager.packed.numel() == uniform_layout(n, 3, width, spec=True).total
    # one-token decodes of a k = 0 engine carry no snapshot slots
    plain = build_uniform([dataclasses.replace(p, tokens=p.tokens[:1], spec_slots=None) for p in pieces], s.blocks, 1)
    assert plain.batch.uniform.spec_slots is None and plain.input_ids.tolist() == [p.tokens[0] for p in pieces]


def test_fed_inputs_move_on_the_device_to_the_full_inputs():
    """build_uniform(fed=True) (every row follows a verify in flight) leaves tokens, positions and KV slots to the
    device: after feed_in_flight, with any accepted counts, the graph's inputs equal those from a full build."""
    import torch

    from mtp_ray.engine.graph_ops import feed_in_flight_torch
    from mtp_ray.engine.inputs import build_uniform, target_pieces, uniform_layout

    s = make(k=2)
    for i in range(3):
        s.add(req(i, 3 + 4 * i))
    while any(r.num_computed < len(r.prompt_ids) for r in s.running) or len(s.running) < 3:
        run_step(s)
    for r in s.running:
        r.drafts = [11, 12]
    pieces = target_pieces(s.schedule())
    n, lay = len(pieces), uniform_layout(4, 3, 6, spec=True)
    full, fed = (build_uniform(pieces, s.blocks, 3, size=4, width=6, fed=f) for f in (False, True))
    assert fed.input_ids[: 3 * n].eq(0).all() and fed.batch.slot_mapping[: 3 * n].eq(0).all()
    src = torch.tensor([2, 0, 1, -1])  # rows 0..2 follow rows of the step in flight; row 3 is padding
    next_ids, drafts = torch.arange(100, 109), torch.tensor([[21, 22], [23, 24], [25, 26]])
    for accepted in ([0, 0, 0], [2, 1, 0], [1, 2, 2]):
        moved = []
        for inp in (full, fed):
            v = lay.views(inp.packed.clone())
            feed_in_flight_torch(v, src, torch.tensor(accepted), next_ids, drafts, 3, 2, s.blocks.block_size)
            moved.append(v)
        for name in moved[0]:
            assert torch.equal(moved[0][name], moved[1][name]), (accepted, name)


def _check_rows(inp, pieces, blocks) -> None:
    """inp's live tokens and tables equal a per-token reference built from each piece."""
    ids = [x for p in pieces for x in p.tokens]
    pos = [x for p in pieces for x in range(p.start, p.start + len(p.tokens))]
    slots = [blocks.slot_of(p.req, x) for p in pieces for x in range(p.start, p.start + len(p.tokens))]
    t = len(ids)
    assert inp.input_ids[:t].tolist() == ids and inp.positions[:t].tolist() == pos
    assert inp.batch.slot_mapping[:t].tolist() == slots
    for b, p in enumerate(pieces):
        row = inp.batch.block_tables[b].tolist()
        assert row[: len(p.req.block_ids)] == p.req.block_ids and not any(row[len(p.req.block_ids) :])


def test_general_inputs_equal_a_per_token_reference():
    """build (prefill chunks, decodes and verifies in one batch): tokens, positions, KV slots, ragged block tables,
    logit rows and snapshot slots as a per-token construction gives them."""
    from mtp_ray.engine.inputs import Piece, build

    s = make(k=2, block_size=4)
    reqs = [req(i, n) for i, n in enumerate([3, 9, 14])]
    for r in reqs:
        assert s.blocks.ensure(r, len(r.prompt_ids) + 3)
    pieces = [Piece(reqs[0], 0, [1, 2, 3], "last"), Piece(reqs[1], 4, [5, 6, 7, 8], "none"),
              Piece(reqs[2], 11, [12, 13, 14], "all", reqs[2].state_slots[1:4])]
    inp = build(pieces, s.blocks)
    _check_rows(inp, pieces, s.blocks)
    assert inp.logit_rows == [[2], [], [7, 8, 9]]
    assert inp.batch.query_lens == [3, 4, 3] and inp.batch.context_lens == [0, 4, 11]
    assert inp.batch.spec_state_slots == [[], [], reqs[2].state_slots[1:4]]
    assert inp.batch.state_slots == [r.state_slots[0] for r in reqs]


def test_in_flight_tokens_count_but_read_as_placeholders():
    """Async scheduling: a token still on the device counts in num_tokens (the request decodes after it) and reads
    as 0 until committed; a request whose in-flight token reaches max_tokens is not scheduled again."""
    s = make(num_blocks=8, block_size=4)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=3))
    s.add(r)
    run_step(s)  # prefill: token 7 committed
    r.num_computed += 1  # a decode launched; its token stays on the device
    r.num_inflight = 1
    assert r.num_tokens == 5 and r.num_known == 4 and r.is_decode
    assert r.tokens(3, 5) == [7, 0] and r.tokens(4, 5) == [0] and r.tokens(0, 4) == [1, 2, 3, 7]
    assert not r.ends_in_flight
    (sc,) = s.schedule()
    assert sc.num_new == 1 and sc.completes_prefill
    r.num_computed += 1
    r.num_inflight = 2  # 1 committed + 2 in flight = max_tokens
    assert r.ends_in_flight and s.schedule() == []


def test_may_preempt_only_when_blocks_may_run_out():
    s = make(num_blocks=5, block_size=4)  # 4 usable blocks
    a, b = req(0, 4), req(1, 4)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled (one block each) with one output each: the next decodes start a block each
    assert a.is_decode and b.is_decode and s.blocks.num_free_blocks == 2
    assert not s.may_preempt()  # each next decode needs one more block: 2 free
    s.blocks.free_blocks.popleft()
    assert s.may_preempt()  # 2 needed, 1 free
    c = req(2, 30)
    s.running.append(c)  # a running prefill may need any number of blocks
    s.blocks.free_blocks.append(4)
    assert s.may_preempt()


def test_append_equals_a_per_token_reference():
    """OutputProcessor._append (one scan, lists extended) keeps the tokens, finish reason and stop reason a
    token-by-token loop gives: EOS / stop ids (stop wins over a length limit at the same token), max_tokens and the
    model context, ignore_eos, empty deltas."""
    from mtp_ray.engine.outputs import OutputProcessor

    def reference(prompt, out, toks, eos, stop_ids, ignore_eos, max_tokens, max_len):
        out = list(out)
        for i, t in enumerate(toks):
            out.append(t)
            if (t in eos and not ignore_eos) or t in stop_ids:  # the primary end token (eos[0]): no stop_reason
                return i + 1, "stop", t if t in stop_ids or t != eos[0] else None
            if (max_tokens is not None and len(out) >= max_tokens) or len(prompt) + len(out) >= max_len:
                return i + 1, "length", None
        return len(toks), None, None

    rng = random.Random(7)
    for case in range(3000):
        prompt = [5] * rng.randint(1, 6)
        out = [rng.randint(1, 9) for _ in range(rng.randint(0, 6))]
        toks = [rng.randint(0, 9) for _ in range(rng.randint(0, 5))]
        eos = (0, 8)  # the tokenizer's end token, one more from generation_config
        stop_ids = rng.choice([[], [3], [3, 7]])
        ignore_eos = rng.random() < 0.3
        max_tokens = rng.choice([None, len(out) + rng.randint(1, 6)])
        max_len = len(prompt) + len(out) + rng.randint(1, 7)
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        req = Request(f"r{case}", prompt, params, output_ids=list(out), output_logprobs=[0.0] * len(out),
                      top_logprobs=[{}] * len(out))
        sched = make()
        sched.add(req)
        proc = OutputProcessor(sched, {req.request_id: req}, eos, max_len, {})
        kept = proc._append(req, toks, [-float(t) for t in toks], [{t: -1.0} for t in toks])
        want, reason, stop_reason = reference(prompt, out, toks, eos, stop_ids, ignore_eos, max_tokens, max_len)
        assert kept == want, case
        assert req.output_ids == out + toks[:want]
        assert req.output_logprobs[len(out) :] == [-float(t) for t in toks[:want]]
        assert req.top_logprobs[len(out) :] == [{t: -1.0} for t in toks[:want]]
        assert req.finish_reason == reason and req.stop_reason == stop_reason, case
        assert req.finished == (reason is not None)


def test_wave_is_stamped_into_every_dpmeta_and_checked_across_ranks():
    """Rule 5: the sync's wave counter goes into each gathered DPMeta (it moves at every wave end), and a rank in
    another wave is a lock-step error naming it (it used to be 0 forever: the check could not fire)."""
    import pytest
    import torch

    from mtp_ray.parallel.context import DistContext
    from mtp_ray.parallel.dp_meta import DPMeta, Gathered, LockstepError
    from mtp_ray.parallel.sync import DPSync

    sync = DPSync(DistContext(0, 1, 4, torch.device("cpu"), 10.0))  # a group of one: no collective
    for wave in range(3):
        with sync.agree(DPMeta(num_tokens=1, batch_size=1, is_dummy=0, has_unfinished=1)) as table:
            assert table is not None and table.ranks[0].wave == wave == sync.wave
        sync.end_wave()
    assert sync.counters["waves"] == 3
    same = Gathered((DPMeta(wave=2, step=7), DPMeta(wave=2, step=7), DPMeta(wave=2, step=7)))
    same.check(0)
    odd = Gathered((DPMeta(wave=2, step=7), DPMeta(wave=3, step=7), DPMeta(wave=2, step=7)))
    with pytest.raises(LockstepError, match=r"disagree on wave: rank 0=2, rank 1=3, rank 2=2 \(odd one out: rank 1\)"):
        odd.check(0)
