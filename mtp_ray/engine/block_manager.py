"""KV block and GDN state-slot bookkeeping (pure Python). Block 0 and slot 0 are reserved for dummy / padded rows.

Blocks live in a PrefixIndex (engine/prefix_cache.py): with prefix caching on, a request's full prompt blocks are
named when it reaches its snapshot boundary and stay cached after it ends, and a later request with the same
prefix starts from them (`match`); with it off nothing is ever named and blocks go straight back to the free list.
The last `snapshot_slots` state slots hold GDN state snapshots, never a running sequence.
"""

from __future__ import annotations

from collections import Counter, deque

from mtp_ray.engine.prefix_cache import BlockHash, Hit, PrefixIndex, prompt_block_names
from mtp_ray.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, slots_per_seq: int,
                 snapshot_slots: int = 0, lookahead: int = 0):
        assert num_blocks >= 2 and num_state_slots >= 1 + slots_per_seq + snapshot_slots
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slots_per_seq = slots_per_seq  # main slot + k+1 speculative snapshot slots
        first_snap = num_state_slots - snapshot_slots
        self.index = PrefixIndex(num_blocks, block_size, list(range(first_snap, num_state_slots)))
        self.caching = snapshot_slots > 0
        self.lookahead = lookahead  # 1 with MTP: a block's name includes the token after it (block_hashes)
        self.free_slots: deque[int] = deque(range(1, first_snap))

    @property
    def free_blocks(self) -> deque[int]:
        """Blocks with no content (cached ones are evictable on top of these: num_free_blocks)."""
        return self.index.free

    def usage(self) -> float:
        """The share of KV blocks held by sequences (block 0, the dummy block, and evictable cached blocks not
        counted)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_free_blocks(self) -> int:
        return self.index.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_hold(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - len(req.block_ids)
        slots = 0 if req.state_slots else self.slots_per_seq
        return need <= self.num_free_blocks and slots <= len(self.free_slots)

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Give req blocks for positions [0, num_tokens) and its state slots; all or nothing."""
        if not self.can_hold(req, num_tokens):
            return False
        while len(req.block_ids) < self.blocks_for(num_tokens):
            req.block_ids.append(self.index.allocate())
        if not req.state_slots:
            req.state_slots = [self.free_slots.popleft() for _ in range(self.slots_per_seq)]
        return True

    def free(self, req: Request) -> None:
        self.index.release(req.block_ids)
        self.free_slots.extend(req.state_slots)
        req.block_ids = []
        req.state_slots = []

    # ---- prefix caching ----
    def prefix_hashes(self, req: Request) -> list[BlockHash]:
        """Names of the full blocks a request can take from the cache or leave in it: those before its last known
        token (whose logits it must compute itself)."""
        if req.hashed_known != req.num_known:  # computed once per set of known tokens (a waiting request is asked
            # again every step while others are admitted)
            req.prefix_hashes = prompt_block_names(req.all_ids[: req.num_known], self.block_size, self.lookahead,
                                                   req.params.cache_salt)
            req.hashed_known = req.num_known
        return req.prefix_hashes

    def match(self, req: Request, hashes: list[BlockHash]) -> Hit | None:
        """A cached prefix for a request that holds nothing yet; its blocks become the request's."""
        assert not req.block_ids and req.num_computed == 0
        hit = self.index.match(hashes)
        if hit is not None:
            req.block_ids = list(hit.blocks)
        return hit

    def publish(self, req: Request, point: int) -> int | None:
        """req has computed (or this step computes) its tokens up to the snapshot point `point`: name its blocks
        before it, and return the state slot for its GDN state there (None: that snapshot exists already, or the
        step has no slot left for it)."""
        hashes = req.prefix_hashes[: point // self.block_size]
        for b, h in zip(req.block_ids, hashes, strict=False):
            self.index.publish(b, h)
        return self.index.snapshot_slot(hashes[-1])

    def prefix_stats(self) -> dict:
        """vLLM's counters (tokens looked up / found at admission) and the pools' sizes, for get_stats."""
        ix = self.index
        return {"enabled": self.caching, "prefix_cache_queries": ix.query_tokens, "prefix_cache_hits": ix.hit_tokens,
                "requests_queried": ix.queries, "cached_blocks": len(ix.cached), "named_blocks": len(ix.by_hash),
                "evictions": ix.evictions, "snapshots": len(ix.snaps),
                "snapshot_slots": len(ix.snaps) + len(ix.snap_free)}

    def slot_of(self, req: Request, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def check(self, live: list[Request]) -> None:
        """Invariant: every block is free, cached or held by exactly the live requests that list it; every state
        slot is free or owned by exactly one live request."""
        self.index.check()
        assert Counter(b for r in live for b in r.block_ids) == Counter(self.index.refs)
        slots = [s for r in live for s in r.state_slots]
        assert len(slots) == len(set(slots)) and not set(slots) & set(self.free_slots)
