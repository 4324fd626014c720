"""MTP draft loop: k chained forwards of the one MTP layer after each target step.

Step 1 runs over every position p the target just committed, with input (token[p+1], h[p]): it fills the MTP
KV cache for those positions and its last row gives draft 1. (A non-last prefill chunk's next token is the next
prompt token, so no hidden state needs to carry over between chunks.) Step j > 1 feeds draft j-1 and the MTP's
own hidden from step j-1 back in, one token per sequence at the next position.

With CUDA graphs the loop is one graph after a graph target step (`propose_graph`), and, in an engine of one rank,
also after an eager one such as a prefill (`propose_after_eager`): step 1 runs eagerly up to each sequence's last
k + 1 rows and the graph takes it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_ray.engine.block_manager import BlockManager
from mtp_ray.engine.inputs import Piece, StepInputs, build, build_uniform, dummy_inputs
from mtp_ray.engine.request import Request
from mtp_ray.engine.runner import ModelRunner
from mtp_ray.engine.sampler import draft_probs, draw
from mtp_ray.engine.stats import EngineStats
from mtp_ray.parallel.dp_meta import DPMeta, Gathered
from mtp_ray.parallel.sync import Sync


@dataclass
class DraftItem:
    req: Request
    start: int  # first position the target committed this step
    hidden: torch.Tensor  # [L, H] target hidden at positions start .. start + L - 1 (a verify: all k + 1 rows)
    wants_drafts: bool  # False for a non-last prefill chunk: only its MTP KV is filled
    index: int = 0  # the sequence's row in the step's batch (graph drafts read its rows of the static buffers)
    committed: int | None = None  # rows the target committed (accepted drafts + 1); None: all L
    block_ids: list[int] | None = None  # a finished request's block table (Piece.block_ids): KV-only step 1

    @property
    def n(self) -> int:
        return self.hidden.shape[0] if self.committed is None else self.committed

    def next_tokens(self) -> list[int]:
        """The token after every committed position (MTP step 1's inputs)."""
        toks = self.req.tokens(self.start + 1, self.start + 1 + self.n)
        assert len(toks) == self.n, "MTP step 1 needs the token after every committed position"
        return toks


class MTPProposer:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, k: int, sync: Sync, stats: EngineStats):
        self.runner, self.blocks, self.k, self.sync, self.stats = runner, blocks, k, sync, stats

    def propose(self, items: list[DraftItem], table: Gathered | None) -> None:
        """Runs the k draft forwards. In lock-step (DP) mode all k run whatever this rank holds: a rank without
        drafting work feeds a dummy token, so every rank issues the same collectives. When the target step ran
        as a graph and every rank drafts greedily (decided from the gathered table), the loop is one graph."""
        if self.k == 0 or (not items and not self.sync.lockstep):
            return
        if table is not None and table.graph_drafts:
            self.propose_graph(items, table)
            return
        if table is not None and self.propose_after_eager(items, table):
            return
        inp, hidden = self._first_inputs(items)
        live = [it for it in items if it.wants_drafts]
        drafts: list[list[int]] = [[] for _ in live]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        last_pos = [it.start + it.n - 1 for it in live]
        nseq = len(items)  # sequences in this draft forward
        for step in range(self.k):
            with self.sync.drafting(DPMeta(num_tokens=inp.num_tokens, batch_size=nseq, is_dummy=int(not nseq),
                                           forward_idx=step + 1, has_unfinished=1)):
                h = self.runner.mtp_forward(inp, hidden, step)  # [T, H]
            if step + 1 < self.k and not live and not self.sync.lockstep:
                return
            rows = [r for rs in inp.logit_rows for r in rs]
            h_last = h[rows] if live else self._dummy_hidden()  # [B, H]
            if live:
                self._draft_rows(self.runner.draft_logits(h_last), live, drafts, probs)
            if step + 1 == self.k:
                break
            # next step: one token per live sequence, at the position after its last one
            last_pos = [p + 1 for p in last_pos]
            pieces = [Piece(it.req, last_pos[b], [drafts[b][-1]], "last") for b, it in enumerate(live)]
            # one token per sequence on a cached prefix: the batched decode form (no per-sequence attention loop)
            inp = build_uniform(pieces, self.blocks, 1) if pieces else dummy_inputs()
            nseq = len(pieces)
            hidden = h_last
        for b, it in enumerate(live):
            it.req.drafts = drafts[b]
            it.req.draft_probs = torch.stack(probs[b]) if probs[b] else None

    def _first_inputs(self, items: list[DraftItem]) -> tuple[StepInputs, torch.Tensor]:
        """Draft step 1: (token[p + 1], h[p]) for every committed position p. After a uniform verify step every
        sequence feeds all its k + 1 rows (a uniform batch: batched attention); rows past the accepted ones feed
        token 0 and write MTP KV that the draft steps and the next step overwrite before anything reads it, as
        in the graph draft loop. Otherwise (prefill pieces, mixed steps) exactly the committed rows."""
        if not items:
            return dummy_inputs(), self._dummy_hidden()
        q = self.k + 1
        if all(it.wants_drafts and it.hidden.shape[0] == q and it.committed is not None and it.start > 0
               for it in items):
            pieces = [Piece(it.req, it.start, it.next_tokens() + [0] * (q - it.n), "all") for it in items]
            inp = build_uniform(pieces, self.blocks, q)
            inp.logit_rows = [[b * q + it.n - 1] for b, it in enumerate(items)]  # the last committed row
            return inp, torch.cat([it.hidden for it in items])
        pieces = [Piece(it.req, it.start, it.next_tokens(), "last" if it.wants_drafts else "none",
                        block_ids=it.block_ids) for it in items]
        return build(pieces, self.blocks), torch.cat([it.hidden[: it.n] for it in items])

    def propose_graph(self, items: list[DraftItem], table: Gathered) -> None:
        size, q = table.graph_size, self.k + 1
        next_ids = torch.zeros(size * q, dtype=torch.long)
        last = torch.zeros(size, dtype=torch.long)
        for it in items:
            next_ids[it.index * q : it.index * q + it.n] = torch.tensor(it.next_tokens())
            last[it.index] = it.n - 1  # the last committed row
        drafts = self.replay_graph(table, next_ids, last)
        assert drafts is not None
        drafts = drafts.cpu()  # [size, k]
        for it in items:
            it.req.drafts = drafts[it.index].tolist()
            it.req.draft_probs = None

    def propose_after_eager(self, items: list[DraftItem], table: Gathered) -> bool:
        """After a target forward that was not a uniform graph step (prefill pieces, mixed steps), in an engine of
        one rank with graphs (the offline engine, or a DP group of one: serving on one GPU): MTP step 1 runs
        eagerly over every committed row except each drafting sequence's last q = k + 1, and the draft-loop graph
        runs from those q rows as after a verify that accepted all its drafts (last = q - 1); a verify row of a
        mixed step goes to the graph as after any verify (its q rows, last = its committed rows - 1). One eager
        forward and one replay instead of k eager forwards, which cost as much host time as a dozen graph steps.
        Same inputs, same positions, same MTP KV writes; False (nothing run) when a sequence does not fit: a sampled
        one, a prefill with fewer than q committed rows or no rows before them, or no captured graph large enough.
        A DP group of more ranks keeps the eager loop: the graph runs the low-latency EP exchange, and a draft loop
        keeps its target step's EP mode (docs/design.md, rule 4); a group of one has no EP exchange."""
        graphs, q = self.runner.graphs, self.k + 1
        want = [it for it in items if it.wants_drafts]
        if graphs is None or not self.sync.single_rank or not want or any(
                not it.req.params.greedy or not _verify(it, q) and (it.n < q or it.start + it.n - q < 1)
                for it in want):
            return False
        b = graphs.ready_size(len(want))
        if not b:
            return False
        nxt = {id(it): it.next_tokens() for it in items}  # step 1's inputs, split between the eager part and the graph
        heads = [(it, 0 if _verify(it, q) else it.n - q if it.wants_drafts else it.n) for it in items]
        heads = [(it, m) for it, m in heads if m > 0]
        if heads:  # step 1 up to the last q rows: fills the MTP KV the graph's attention reads
            inp = build([Piece(it.req, it.start, nxt[id(it)][:m], "none", block_ids=it.block_ids) for it, m in heads],
                        self.blocks)
            with self.sync.drafting(DPMeta(num_tokens=inp.num_tokens, batch_size=len(heads), is_dummy=0,
                                           forward_idx=1, has_unfinished=1)):
                self.runner.mtp_forward(inp, torch.cat([it.hidden[:m] for it, m in heads]), 0)
        r = self.runner
        # per drafting sequence its q graph rows: the first position, the target's tokens there (a verify's rows
        # past the committed ones: 0), the token after each, and the last committed row among them
        tails = [(it.start, it.req.tokens(it.start, it.start + it.n) + [0] * (q - it.n),
                  nxt[id(it)] + [0] * (q - it.n), it.n - 1) if _verify(it, q) else
                 (it.start + it.n - q, it.req.tokens(it.start + it.n - q, it.start + it.n), nxt[id(it)][it.n - q :],
                  q - 1) for it in want]
        inp = build_uniform([Piece(it.req, t[0], t[1], "all") for it, t in zip(want, tails, strict=True)], self.blocks,
                            q, b, r.blocks_per_seq)
        hidden = torch.zeros(b * q, r.model_config.hidden_size, dtype=r.dtype, device=r.device)  # [b * q, H]
        hidden[: len(want) * q] = torch.cat([it.hidden if _verify(it, q) else it.hidden[it.n - q : it.n]
                                             for it in want])
        next_ids = torch.zeros(b * q, dtype=torch.long)  # the token after each of the q rows
        next_ids[: len(want) * q] = torch.tensor([x for t in tails for x in t[2]])
        last = torch.full((b,), q - 1, dtype=torch.long)
        last[: len(want)] = torch.tensor([t[3] for t in tails])
        with self.sync.draft_graph(table):
            drafts = r.replay_drafts_after_eager(inp, hidden, next_ids, last, b).cpu()  # [b, k]
        for i, it in enumerate(want):
            it.req.drafts = drafts[i].tolist()
            it.req.draft_probs = None
        self.stats.count_draft_graph_after_eager()
        return True

    def replay_graph(self, table: Gathered, next_ids: torch.Tensor | None = None, last: torch.Tensor | None = None,
                     fused: bool = False) -> torch.Tensor | None:
        """The draft-loop graph of the step's padded size, in lock-step with the group -> drafts [size, k] on the
        device. next_ids / last None: the target graph already put them on the device. fused: the loop already ran
        in the target's launch (the fused graph); counted as a draft loop all the same, as on every other rank."""
        if fused:  # counted only (no forward to pair with the table: a context manager's cost a step, saved)
            self.sync.graph_drafts(table)
            self.sync.done()
            return None
        with self.sync.draft_graph(table):
            return self.runner.replay_drafts(next_ids, last, table.graph_size)

    def _dummy_hidden(self) -> torch.Tensor:
        r = self.runner
        return torch.zeros(1, r.model_config.hidden_size, dtype=r.dtype, device=r.device)

    @staticmethod
    def _draft_rows(logits: torch.Tensor, live: list[DraftItem], drafts: list[list[int]],
                    probs: list[list[torch.Tensor]]) -> None:
        """logits: [B, V] fp32 on the device, one row per live sequence. Greedy rows take the argmax there; only
        sampled rows (whose draft distribution the rejection sampler needs) come to the host."""
        greedy = logits.argmax(-1).tolist()
        sampled = [b for b, it in enumerate(live) if not it.req.params.greedy]
        host = dict(zip(sampled, logits[sampled].cpu(), strict=True)) if sampled else {}
        for b, it in enumerate(live):
            p = it.req.params
            if p.greedy:
                drafts[b].append(greedy[b])
                continue
            q = draft_probs(host[b], p.temperature)
            drafts[b].append(draw(q, it.req.generator))
            probs[b].append(q)


def _verify(it: DraftItem, q: int) -> bool:
    """A verify row of the step: all q target rows kept, `committed` of them accepted, on a cached prefix. (A
    prefill piece of q rows on a cached prefix reads the same, and takes the graph as a prefill's last q rows would:
    head 0, last q - 1.)"""
    return it.committed is not None and it.hidden.shape[0] == q and it.start > 0
