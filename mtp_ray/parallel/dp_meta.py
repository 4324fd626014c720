"""DPMeta: each rank's per-forward state, all-gathered before every forward (target and each draft step).

Every choice that changes the sequence or shape of collectives is a pure function of the gathered table
(`Gathered`), computed identically on every rank. The table also carries lock-step checks: all ranks must be in
the same wave, step and forward, and must have issued the same number of collectives so far.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

EP_NORMAL, EP_LOW_LATENCY = 0, 1
EP_MODE_NAMES = {EP_NORMAL: "normal", EP_LOW_LATENCY: "low_latency"}


class LockstepError(RuntimeError):
    """Ranks disagree on something that must be identical: raised instead of letting the group hang."""


@dataclass
class DPMeta:
    num_tokens: int = 0  # tokens this rank feeds into this forward (1 for a dummy)
    batch_size: int = 0  # sequences in this forward
    is_decoding: int = 0  # pure decode / verify batch
    is_dummy: int = 1  # no real work: a padded 1-token forward whose output is discarded
    is_chunk: int = 0  # holds a non-last prefill chunk
    has_unfinished: int = 0  # requests waiting or running on this rank
    is_sleeping: int = 0
    draft_num_tokens: int = 0  # tokens of the first MTP forward that will follow (target forwards)
    wave: int = 0
    step: int = 0
    forward_idx: int = 0  # 0: target, j: draft step j
    collectives: int = 0  # EP collectives issued so far (lock-step check)
    ep_mode: int = EP_NORMAL  # EP mode this rank used in its previous forward (all must agree)
    next_cmd: int = 0  # sequence number of this rank's oldest pending group command (0: none)
    graph_ok: int = 0  # this rank's batch is a uniform decode / verify batch (or a dummy): graph-capturable
    greedy_ok: int = 1  # every live request drafts greedily: the MTP draft loop may run as one graph
    pending_prefill: int = 0  # prefill work (waiting or partly prefilled requests) left after this step's schedule
    pending_decode: int = 0  # running decodes left to schedule after this step (split scheduling turns)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.long)

    @classmethod
    def from_row(cls, row: list[int]) -> DPMeta:
        return cls(*row)

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


NUM_FIELDS = len(fields(DPMeta))


@dataclass(frozen=True)
class Gathered:
    """The all-gathered table, one DPMeta per rank; every decision below is the same on every rank."""

    ranks: tuple[DPMeta, ...]
    graph_size: int = 0  # > 0: every rank replays the CUDA graph of this batch size (DP-wide padding)
    # tokens per rank the EP backend's low-latency buffers hold (config, the same on every rank): 0 unbounded
    # (torch backend), > 0 a global decode batch larger than this takes the normal protocol (and no graph),
    # -1 never low-latency (the draft forwards of a step whose target forward took the normal protocol)
    ll_max_tokens: int = 0

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def all_dummy(self) -> bool:
        return all(m.is_dummy for m in self.ranks)

    @property
    def any_unfinished(self) -> bool:
        return any(m.has_unfinished for m in self.ranks)

    @property
    def command_ready(self) -> int:
        """A group command runs on every rank at the same step: once every rank has received it."""
        cmds = {m.next_cmd for m in self.ranks}
        return cmds.pop() if len(cmds) == 1 and 0 not in cmds else 0

    @property
    def any_command(self) -> bool:
        return any(m.next_cmd for m in self.ranks)

    @property
    def global_decode(self) -> bool:
        """Every rank holds only decodes or nothing (and someone decodes): the low-latency EP regime."""
        return all(m.is_decoding or m.is_dummy for m in self.ranks) and not self.all_dummy

    @property
    def ep_mode(self) -> int:
        fits = self.ll_max_tokens == 0 or self.max_num_tokens <= self.ll_max_tokens
        return EP_LOW_LATENCY if self.global_decode and fits else EP_NORMAL

    def pick_graph_size(self, sizes: tuple[int, ...]) -> int:
        """The graph batch size of this forward: the smallest captured size that holds the largest batch of any
        rank, when every rank runs a uniform decode batch (or a dummy); 0: eager."""
        if not sizes or self.ep_mode != EP_LOW_LATENCY or not all(m.graph_ok for m in self.ranks):
            return 0  # a graph captures the low-latency exchange: no host sync, fixed shapes
        need = max(m.batch_size for m in self.ranks)
        return next((b for b in sorted(sizes) if b >= need), 0)

    def with_graph_size(self, sizes: tuple[int, ...]) -> Gathered:
        """This table with its graph decision made (graph_size set from the captured sizes)."""
        return replace(self, graph_size=self.pick_graph_size(sizes))

    @property
    def graph_drafts(self) -> bool:
        """The greedy MTP draft loop runs as one graph (no per-draft gathers) on every rank."""
        return self.graph_size > 0 and all(m.greedy_ok for m in self.ranks)

    def next_prefill_turn(self, last_was_prefill: bool) -> bool | None:
        """Split scheduling in a group: whether the next step is a prefill turn on every rank, so that decode
        steps are uniform group-wide (graph-eligible). Alternates while any rank has both kinds of work pending;
        None (each rank decides alone) when the table shows no pending work (e.g. a wave start)."""
        prefill = any(m.pending_prefill for m in self.ranks)
        decode = any(m.pending_decode for m in self.ranks)
        if not prefill and not decode:
            return None
        return prefill and not (decode and last_was_prefill)

    @property
    def max_num_tokens(self) -> int:
        return max(m.num_tokens for m in self.ranks)

    def check(self, rank: int, collectives: bool = True) -> None:
        """Lock-step invariants; the message names the ranks that disagree."""
        names = ("wave", "step", "forward_idx") + (("collectives", "ep_mode") if collectives else ())
        for name in names:
            vals = [getattr(m, name) for m in self.ranks]
            if len(set(vals)) > 1:
                odd = _odd_ranks(vals)
                raise LockstepError(
                    f"lock-step violation seen by rank {rank}: ranks disagree on {name}: "
                    + ", ".join(f"rank {r}={v}" for r, v in enumerate(vals))
                    + f" (odd one out: rank {', '.join(map(str, odd))})\n" + self.describe())

    def describe(self) -> str:
        return "\n".join(f"  rank {r}: {m.describe()}" for r, m in enumerate(self.ranks))


def draft_tables(target: Gathered) -> tuple[Gathered, Gathered]:
    """The tables of the eager draft forwards that follow a target forward, without gathering again: the same
    ranks and EP mode (rule 4), no graph, and token counts that bound what each rank feeds. Draft step 1 runs
    over the rows the target step committed (at most its num_tokens); steps 2..k over one token per sequence
    that drafts (at most its batch_size; 1 for a dummy)."""
    first = replace(target, graph_size=0)
    later = Gathered(tuple(replace(m, num_tokens=max(m.batch_size, 1)) for m in target.ranks),
                     ll_max_tokens=pinned_ll_max_tokens(target))
    assert first.ep_mode == later.ep_mode == target.ep_mode
    return first, later


def pinned_ll_max_tokens(target: Gathered) -> int:
    """The capacity a draft table carries so that it keeps the target's EP mode (rule 4) although it feeds fewer
    tokens: a target that did not fit the low-latency buffers pins its drafts to the normal protocol."""
    return target.ll_max_tokens if target.ep_mode == EP_LOW_LATENCY else -1


def _odd_ranks(vals: list[int]) -> list[int]:
    counts = {v: vals.count(v) for v in vals}
    common = max(counts, key=lambda v: counts[v])
    return [r for r, v in enumerate(vals) if v != common]


def gather(local: DPMeta, group, world: int, rank: int, check_collectives: bool = True) -> Gathered:
    """One all-gather of a small int tensor on the CPU (gloo) group; a group of one keeps its own row (no
    collective: ~0.1-0.6 ms a step saved, the same checks)."""
    if world == 1:
        g = Gathered((replace(local),))
        g.check(rank, check_collectives)
        return g
    import torch.distributed as dist

    t = local.to_tensor()
    out = torch.empty(world * NUM_FIELDS, dtype=torch.long)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)
    g = Gathered(tuple(DPMeta.from_row(r) for r in out.view(world, NUM_FIELDS).tolist()))
    g.check(rank, check_collectives)
    return g
