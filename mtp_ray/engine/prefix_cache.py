"""PrefixIndex (pure Python): which KV blocks and GDN state snapshots hold which token prefix (docs/design.md
10.1; the engine's BlockManager keeps its blocks here).

A full block is named by a chain hash of its tokens and every token before it (`block_hashes`), so equal names
mean equal prefixes. A hybrid model can resume a prefix only where it has both the attention KV of every block
before the boundary and the Gated DeltaNet state (conv + recurrent) after the boundary's last token: KV is paged
and can be shared block by block, the GDN state is one tensor per sequence and must be snapshotted. Snapshots are
taken at block boundaries only (a prefill piece is cut there), kept in a bounded pool of state slots, and named
by the hash of the block that ends at the boundary.

Blocks: every block (0 reserved) is in exactly one place: free (no content), held (reference count > 0), or
cached (no reference, content kept, evictable in LRU order). Allocation takes a free block first, else evicts
the least recently released cached one. Snapshots: a pool of state slots, LRU-evicted when full.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

BlockHash = bytes


def block_hashes(tokens: list[int], block_size: int, parent: BlockHash = b"", lookahead: int = 0
                 ) -> list[BlockHash]:
    """Chain hashes of the full blocks of `tokens` that have `lookahead` more tokens after them: h_i covers tokens
    [0, (i + 1) * block_size + lookahead). With MTP, lookahead = 1: the MTP layer's KV at a block's last position
    is computed from the next token, so a block is only the same block if that token is the same too. blake2b,
    16 bytes: no collision to fear from crafted prompts."""
    arr = np.asarray(tokens, dtype=np.int64)
    out, h = [], parent
    for i in range(max(0, len(tokens) - lookahead) // block_size):
        end = (i + 1) * block_size
        h = hashlib.blake2b(h + arr[end - block_size:end + lookahead].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def prompt_block_names(tokens: list[int], block_size: int, lookahead: int, salt: str | None = None
                       ) -> list[BlockHash]:
    """The names of the full blocks a request can take from the cache or leave in it: those before its last token
    (whose logits it must compute itself), each with its `lookahead` token (block_hashes). A cache salt
    (SamplingParams.cache_salt) starts the chain: only requests with the same salt share blocks."""
    parent = b"" if salt is None else hashlib.blake2b(b"cache_salt:" + salt.encode("utf-8", "surrogatepass"),
                                                      digest_size=16).digest()
    return block_hashes(tokens[: len(tokens) - 1 + lookahead], block_size, parent, lookahead)


@dataclass
class Hit:
    """A matched prefix: its blocks (in order, now held by the caller) and the snapshot slot to restore the GDN state
    from; tokens = len(blocks) * block_size."""

    blocks: list[int]
    snapshot: int
    tokens: int


class PrefixIndex:
    def __init__(self, num_blocks: int, block_size: int, snapshot_slots: list[int]):
        assert num_blocks >= 2 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self.refs: dict[int, int] = {}  # held blocks -> holders
        self.cached: OrderedDict[int, None] = OrderedDict()  # released blocks with content, oldest first
        self.by_hash: dict[BlockHash, int] = {}
        self.hash_of: dict[int, BlockHash] = {}
        self.snap_free: deque[int] = deque(snapshot_slots)
        self.snaps: OrderedDict[BlockHash, int] = OrderedDict()  # boundary hash -> state slot, oldest first
        self.step_slots: set[int] = set()  # snapshot slots being written by the current step (begin_step)
        self.queries = self.hit_tokens = self.query_tokens = self.evictions = 0

    # ---- blocks ----
    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones and evictable cached ones."""
        return len(self.free) + len(self.cached)

    def allocate(self) -> int:
        """A block for new content, held once. Raises when none is available (callers check num_available)."""
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.cached.popitem(last=False)  # the least recently released
            del self.by_hash[self.hash_of.pop(b)]
            self.evictions += 1
        self.refs[b] = 1
        return b

    def release(self, blocks: list[int]) -> None:
        """Drop one hold on each; a block nobody holds stays cached if it has a name, else becomes free. Released
        in reverse so that a sequence's last blocks are evicted first (its prefix is what others share)."""
        for b in reversed(blocks):
            n = self.refs[b] - 1
            if n:
                self.refs[b] = n
                continue
            del self.refs[b]
            if b in self.hash_of:
                self.cached[b] = None
            else:
                self.free.append(b)

    def publish(self, block: int, h: BlockHash) -> None:
        """A held block now holds the full block named h. If another block already has that name, this one stays
        unnamed (a duplicate, freed on release)."""
        assert block in self.refs, "publish a block you hold"
        if h not in self.by_hash and block not in self.hash_of:
            self.by_hash[h] = block
            self.hash_of[block] = h

    # ---- snapshots ----
    def begin_step(self) -> None:
        """A new step's snapshots start: none of its slots is written yet."""
        self.step_slots.clear()

    def snapshot_slot(self, h: BlockHash) -> int | None:
        """The state slot to copy the GDN state at boundary h into (None: already there, or the pool is full of
        snapshots this step writes: two writes to one slot in one step would leave either). Evicts the oldest
        snapshot when the pool is full."""
        if h in self.snaps:
            self.snaps.move_to_end(h)
            return None
        if self.snap_free:
            slot = self.snap_free.popleft()
        else:
            victim = next(iter(self.snaps))
            if self.snaps[victim] in self.step_slots:  # the oldest is written this step: skip this snapshot
                return None
            slot = self.snaps.pop(victim)
        self.snaps[h] = slot
        self.step_slots.add(slot)
        return slot

    # ---- lookups ----
    def count(self, query_tokens: int, hit_tokens: int) -> None:
        """One admitted request's lookup (vLLM's prefix_cache_queries / prefix_cache_hits count tokens)."""
        self.queries += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def named_run(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` are cached (with or without a snapshot at their end)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.by_hash:
            n += 1
        return n

    def match(self, hashes: list[BlockHash]) -> Hit | None:
        """The longest prefix of `hashes` whose blocks are all cached and that ends at a snapshot; its blocks are
        held for the caller. None: no usable prefix. Counted by the caller (`count`) once it keeps the result."""
        n = self.named_run(hashes)
        while n and hashes[n - 1] not in self.snaps:
            n -= 1
        if not n:
            return None
        blocks = [self.by_hash[h] for h in hashes[:n]]
        for b in blocks:
            if b in self.cached:
                del self.cached[b]
                self.refs[b] = 1
            else:
                self.refs[b] += 1
        self.snaps.move_to_end(hashes[n - 1])
        return Hit(blocks, self.snaps[hashes[n - 1]], n * self.block_size)

    def invalidate(self) -> None:
        """Forget every name and snapshot (new weights, reset_prefix_cache, sleep level 2): cached blocks become
        free, held ones stay held but unnamed."""
        self.free.extend(self.cached)
        self.cached.clear()
        self.by_hash.clear()
        self.hash_of.clear()
        self.snap_free.extend(self.snaps.values())
        self.snaps.clear()

    def check(self) -> None:
        """Invariants: every block is free, held or cached, exactly once; names are a bijection on named blocks;
        snapshot slots are free or named, exactly once."""
        free, held, cached = set(self.free), set(self.refs), set(self.cached)
        assert len(free) == len(self.free) and not (free & held or free & cached or held & cached)
        assert free | held | cached == set(range(1, self.num_blocks))
        assert all(n > 0 for n in self.refs.values())
        assert {b: h for h, b in self.by_hash.items()} == self.hash_of
        assert cached <= set(self.hash_of) and not free & set(self.hash_of)
        slots = list(self.snap_free) + list(self.snaps.values())
        assert len(slots) == len(set(slots))
