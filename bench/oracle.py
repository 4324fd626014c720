"""Oracle drafts for the decode benchmark (bench/decode.py --oracle): what MTP gives when every draft is right, and
when each is right with a set probability, on a random-weight model that would otherwise accept nothing.

The target's own greedy continuation is generated first with the plain k = 0 graph (the host builds each step's
positions, the token comes from the previous replay's argmax on the device: the engine's async k = 0 path). The
GDN states are then put back and the k > 0 graphs run the same sequences as the engine's async verify does, with
nothing on the host: each verify moves its rows by the previous verify's accepted count on the device
(graph_ops.feed_in_flight), the draft loop runs, and its drafts are replaced by the continuation's next k tokens,
each corrupted (a token that cannot match) with probability 1 - accept. End-to-end tokens / s = tokens committed /
wall time of that loop, next to the plain loop's; the committed tokens are checked against the continuation.
"""

from __future__ import annotations

import time

import torch

from mtp_ray.engine.graphs import CudaGraphs
from mtp_ray.engine.inputs import StepInputs, uniform_layout
from mtp_ray.model.qwen3_5 import Qwen3_5MoeForCausalLM


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class StateCopy:
    """The GDN conv and recurrent states of some slots, to run two generations from the same start."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, slots: torch.Tensor):
        self.model, self.slots = model, slots
        self.saved = [(g.conv_state[slots].clone(), g.ssm_state[slots].clone()) for g in model.gdn_layers()]

    def restore(self) -> None:
        for g, (conv, ssm) in zip(self.model.gdn_layers(), self.saved, strict=True):
            g.conv_state[self.slots] = conv
            g.ssm_state[self.slots] = ssm


def greedy_continuation(graphs: CudaGraphs, make_inputs, bsz: int, context: int, first: torch.Tensor, steps: int
                        ) -> tuple[torch.Tensor, float]:
    """Plain k = 0 graph steps from `first` [bsz] at position `context` -> tokens [bsz, steps + 1] at positions
    context .. context + steps (column 0 = first), and the wall seconds of steps 2 .. steps (the first, exact,
    step may capture the graph)."""
    assert graphs.k == 0
    toks = torch.empty(bsz, steps + 1, dtype=torch.long, device=first.device)
    toks[:, 0] = first
    lay = uniform_layout(bsz, 1, graphs.width, spec=False)
    rows = list(range(bsz))
    t0 = 0.0
    for t in range(steps):
        inp: StepInputs = make_inputs(context + t, 1)  # built on the host, as the engine does
        if t == 0:
            lay.views(inp.packed)["ids"].copy_(first)
        graphs.run_target(inp, bsz, None if t == 0 else rows)  # t > 0: the token is the last replay's argmax
        toks[:, t + 1] = graphs.next_ids[:bsz]
        if t == 0:
            sync(first.device)
            t0 = time.perf_counter()
    sync(first.device)
    return toks, time.perf_counter() - t0


def verify_loop(graphs: CudaGraphs, make_inputs, bsz: int, context: int, first: torch.Tensor, steps: int,
                set_drafts=None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`steps` MTP steps (async verify; from step 2 the fused graph, verify + draft loop in one launch, as the engine
    replays a plain-greedy step) from first [B, q] (the token at `context` and k drafts, host) -> greedy blocks [S, B,
    2q + 1], each verify's first position [S, B], and the wall seconds of steps 2 .. S. set_drafts(s, ctx, last)
    replaces the draft loop's drafts before step s (None: the MTP's own)."""
    k, q, dev = graphs.k, graphs.q, graphs.device
    assert k > 0 and graphs.feed, "the loop rides the async verify path (device-side acceptance, nothing on the host)"
    inp = make_inputs(context, q)
    uniform_layout(bsz, q, graphs.width, spec=True).views(inp.packed)["ids"].view(bsz, q).copy_(first)
    graphs.run_target(inp, bsz)  # step 1: exact inputs from the host
    graphs.run_drafts(None, None, bsz)
    v = graphs.views(bsz)
    block = graphs.target[bsz][3]  # [B, 2q + 1]
    fused, fused_block = graphs.fused[bsz][0], graphs.fused[bsz][2][:, : block.shape[1]]  # the same columns first
    hist = torch.empty(steps, bsz, block.shape[1], dtype=block.dtype, device=dev)  # [S, B, 2q + 1]
    ctx_hist = torch.empty(steps, bsz, dtype=torch.long, device=dev)
    hist[0], ctx_hist[0] = block, v["ctx"]
    sync(dev)
    t0 = time.perf_counter()
    graphs.src[:bsz] = torch.arange(bsz, device=dev)  # from now on every row follows its own verify in flight
    for s in range(1, steps):
        if set_drafts is not None:
            graphs.drafts[:bsz].copy_(set_drafts(s, v["ctx"], graphs.last[:bsz]))
        v["ctx"].add_(1)  # what the host writes for a row whose verify is in flight: as if it accepted nothing
        fused.replay()  # moves each row by the accepted count, verifies, accepts on the device, drafts
        hist[s].copy_(fused_block)
        ctx_hist[s].copy_(v["ctx"])
    sync(dev)
    return hist.cpu(), ctx_hist.cpu(), time.perf_counter() - t0


def committed(hist: torch.Tensor, ctx: torch.Tensor, first: torch.Tensor, context: int, q: int) -> list[list[int]]:
    """The tokens a verify_loop committed, per sequence from position `context` (first [B] at index 0)."""
    acc = hist[:, :, 2 * q].long()  # [S, B]
    seqs = []
    for b in range(ctx.shape[1]):
        toks = [int(first[b])]
        for s in range(ctx.shape[0]):
            c, a = int(ctx[s, b]) - context, int(acc[s, b])
            assert c + 1 == len(toks), "each verify starts after the tokens committed so far"
            toks += hist[s, b, : a + 1].long().tolist()  # positions ctx + 1 .. ctx + a + 1
        seqs.append(toks)
    return seqs


def oracle_generation(graphs: CudaGraphs, make_inputs, bsz: int, context: int, cont: torch.Tensor, accept: float,
                      steps: int, seed: int = 0) -> dict:
    """verify_loop with drafts = `cont`'s next k tokens (cont [B, n] from position `context`, on the device), each
    kept with probability `accept` (else a token that cannot match) -> tokens committed, wall seconds, mean
    acceptance length (timed steps) and the fraction of committed tokens equal to `cont`."""
    k, q, dev, vocab = graphs.k, graphs.q, cont.device, graphs.model.config.vocab_size
    gen = torch.Generator(device=dev).manual_seed(seed)
    keep = torch.rand(steps, bsz, k, generator=gen, device=dev) < accept  # [S, B, k]
    ar = torch.arange(k, device=dev)

    def drafts(s: int, ctx: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        # the next verify starts at the bonus token (ctx + accepted + 1): drafts for the k positions after it
        right = cont.gather(1, ((ctx - context + last + 2)[:, None] + ar).clamp(max=cont.shape[1] - 1))  # [B, k]
        return torch.where(keep[s], right, (right + 1) % vocab)

    first = cont[:, :q].clone()
    first[:, 1:] = drafts(0, torch.full((bsz,), context - 1, device=dev), torch.zeros(bsz, dtype=torch.long,
                                                                                        device=dev))
    hist, ctx_hist, wall = verify_loop(graphs, make_inputs, bsz, context, first.cpu(), steps, drafts)
    cont = cont.cpu()
    same = total = 0
    for b, toks in enumerate(committed(hist, ctx_hist, cont[:, 0], context, q)):
        n = min(len(toks), cont.shape[1])
        same += sum(int(t == w) for t, w in zip(toks[1:n], cont[b, 1:n].tolist(), strict=True))
        total += n - 1
    timed = hist[1:, :, 2 * q].long() + 1  # tokens each timed step committed [S - 1, B]
    return {"accept": accept, "tokens": int(timed.sum()), "steps": steps - 1,
            "mean_acceptance_length": round(float(timed.float().mean()), 3),
            "agreement": round(same / max(total, 1), 4), "wall_s": wall}


def continuation_length(steps: int, k: int) -> int:
    """Tokens of continuation `steps` oracle verifies may draft from."""
    return (steps + 1) * (k + 1) + k + 2


def positions_needed(steps: int, k: int) -> int:
    """Positions past the context the oracle runs may write: the continuation's verify loop commits 1 .. k + 1
    tokens a step for continuation_length steps."""
    return (continuation_length(steps, k) + 1) * (k + 1)


def oracle_rows(model: Qwen3_5MoeForCausalLM, bsz: int, context: int, width: int, k: int, accepts: list[float],
                steps: int, make_inputs, dev: torch.device, block_size: int, draft_vocab: int = 0) -> dict:
    """Plain k = 0 loop, then one oracle MTP loop per acceptance rate, from the same GDN states and first token
    (the draft loop drafting from ids [0, draft_vocab), 0: all; its drafts are replaced either way)."""
    g0 = CudaGraphs(model, (bsz,), 0, width, block_size, dev)
    gk = CudaGraphs(model, (bsz,), k, width, block_size, dev, async_verify=True, draft_vocab=draft_vocab)
    states = StateCopy(model, torch.arange(1, 1 + bsz, device=dev))  # inputs() puts sequence b in slot 1 + b
    # capture both graphs first (a capture runs the step once): then every loop below starts from the same state
    gk.run_target(make_inputs(context, k + 1), bsz)
    gk.run_drafts(None, None, bsz)
    first = torch.randint(0, model.config.vocab_size, (bsz,), device=dev)
    n_cont = continuation_length(steps, k)
    states.restore()
    plain, plain_wall = greedy_continuation(g0, make_inputs, bsz, context, first, n_cont)
    # the continuation the drafts are taken from: the verify graph's own greedy output (the MTP's drafts, rarely
    # right on random weights: about one token per step). In bf16 a 1-row step and a (k + 1)-row verify round
    # differently, and random weights leave near-ties, so the plain steps' tokens are no oracle for the verify
    states.restore()
    seed = torch.zeros(bsz, k + 1, dtype=torch.long)
    seed[:, 0] = first.cpu()
    hist, ctx_hist, _ = verify_loop(gk, make_inputs, bsz, context, seed, n_cont)
    seqs = committed(hist, ctx_hist, first.cpu(), context, k + 1)
    cont = torch.tensor([t[: n_cont + 1] for t in seqs])  # every verify commits >= 1 token: n_cont + 1 at least
    same = (cont == plain.cpu()[:, : cont.shape[1]]).long().cumprod(1).sum(1)  # common prefix per sequence
    out = {"plain": {"tokens": bsz * (n_cont - 1), "wall_s": plain_wall,
                     "tokens_per_s": round(bsz * (n_cont - 1) / plain_wall, 1),
                     "common_prefix_with_verify_tokens": same.tolist()}, "runs": []}
    cont = cont.to(dev)
    for accept in accepts:
        states.restore()
        r = oracle_generation(gk, make_inputs, bsz, context, cont, accept, steps)
        r["tokens_per_s"] = round(r["tokens"] / r["wall_s"], 1)
        r["over_plain"] = round(r["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
        r["expected_acceptance_length"] = round(sum(accept ** i for i in range(k + 1)), 3)
        out["runs"].append(r)
    return out
