"""PrefixIndex (issue 26, step 1: bookkeeping, CPU, no engine): chain hashes, reference counts, LRU eviction of
blocks and of GDN state snapshots, hits only where both exist, invalidation, no leak under random use."""

from __future__ import annotations

import random

from mtp_ray.engine.prefix_cache import PrefixIndex, block_hashes

B = 4


def test_block_hashes_name_whole_prefixes():
    a = list(range(10))
    ha = block_hashes(a, B)
    assert len(ha) == 2 and len(set(ha)) == 2  # the partial last block has no name
    b = a[:5] + [99] + a[6:]  # differs in block 1 only
    hb = block_hashes(b, B)
    assert hb[0] == ha[0] and hb[1] != ha[1]
    assert block_hashes(a[4:8], B, parent=ha[0]) == ha[1:]  # a chain continues from its parent
    assert block_hashes(a[4:8], B) != ha[1:]  # the same tokens after another prefix are another block


def served(idx: PrefixIndex, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """A request that computed `tokens` (in a step of its own): its blocks, each full one published, a snapshot at
    its last boundary."""
    idx.begin_step()
    hashes = block_hashes(tokens, B)
    blocks = [idx.allocate() for _ in range(-(-len(tokens) // B))]
    for blk, h in zip(blocks, hashes, strict=False):
        idx.publish(blk, h)
    if hashes:
        idx.snapshot_slot(hashes[-1])
    return blocks, hashes


def test_a_hit_takes_the_longest_prefix_with_blocks_and_a_snapshot():
    idx = PrefixIndex(num_blocks=16, block_size=B, snapshot_slots=[5, 6])
    toks = list(range(100, 111))  # 2 full blocks + 3 tokens
    blocks, hashes = served(idx, toks)
    idx.release(blocks)
    idx.check()
    assert idx.num_available == 15  # cached blocks are available (evictable)
    hit = idx.match(block_hashes(toks + [7, 8, 9], B))  # 3 full blocks now; the third was never cached
    assert hit is not None and hit.blocks == blocks[:2] and hit.tokens == 8 and hit.snapshot in (5, 6)
    assert all(idx.refs[b] == 1 for b in hit.blocks)
    again = idx.match(hashes)  # a second holder of the same blocks
    assert again is not None and all(idx.refs[b] == 2 for b in hit.blocks)
    idx.check()
    # blocks cached up to 2, but a snapshot only at 2: a prefix of 1 block has none -> a one-block query misses
    assert idx.match(hashes[:1]) is None


def test_eviction_takes_the_least_recently_released_and_forgets_its_name():
    idx = PrefixIndex(num_blocks=7, block_size=B, snapshot_slots=[1, 2, 3])
    a_blocks, a_hashes = served(idx, list(range(8)))  # 2 blocks
    b_blocks, b_hashes = served(idx, list(range(50, 58)))
    idx.release(a_blocks)
    idx.release(b_blocks)  # cached, oldest first: a's (last block first), then b's
    fresh = [idx.allocate() for _ in range(4)]  # 2 free + evicts a's two blocks
    idx.check()
    assert idx.evictions == 2 and set(a_blocks) <= set(fresh)
    assert idx.match(a_hashes) is None  # a's blocks are gone
    hit = idx.match(b_hashes)
    assert hit is not None and hit.blocks == b_blocks
    idx.release(fresh + hit.blocks)
    idx.check()


def test_snapshot_pool_is_bounded_and_lru():
    idx = PrefixIndex(num_blocks=32, block_size=B, snapshot_slots=[1, 2])
    reqs = [served(idx, [i] * 8) for i in range(3)]  # three snapshots, two slots: the first is evicted
    for blocks, _ in reqs:
        idx.release(blocks)
    assert idx.match(reqs[0][1]) is None
    assert idx.match(reqs[1][1]) is not None and idx.match(reqs[2][1]) is not None
    assert sorted(idx.snaps.values()) == [1, 2]
    assert idx.snapshot_slot(reqs[2][1][-1]) is None  # already snapshotted: nothing to copy
    idx.check()


def test_one_step_never_gets_one_snapshot_slot_twice():
    idx = PrefixIndex(num_blocks=32, block_size=B, snapshot_slots=[1, 2])
    names = [bytes([i]) * 16 for i in range(4)]
    idx.begin_step()
    assert [idx.snapshot_slot(h) for h in names[:3]] == [1, 2, None]  # the third would evict this step's first
    assert list(idx.snaps) == names[:2]
    idx.begin_step()
    assert idx.snapshot_slot(names[2]) == 1 and idx.snapshot_slot(names[3]) == 2  # a new step: LRU again
    idx.check()


def test_invalidate_forgets_everything_and_held_blocks_stay_held():
    idx = PrefixIndex(num_blocks=10, block_size=B, snapshot_slots=[1])
    a, ha = served(idx, list(range(8)))
    b, hb = served(idx, list(range(20, 28)))
    idx.release(a)
    idx.invalidate()  # e.g. update_weights
    idx.check()
    assert idx.match(ha) is None and idx.match(hb) is None
    assert idx.num_available == 9 - len(b)  # b is still held, unnamed
    idx.release(b)
    assert idx.num_available == 9 and not idx.cached  # unnamed: freed, not cached
    idx.check()


def test_random_use_keeps_invariants_and_leaks_nothing():
    rng = random.Random(0)
    idx = PrefixIndex(num_blocks=40, block_size=B, snapshot_slots=[1, 2, 3, 4])
    prompts = [[rng.randrange(5) for _ in range(rng.randint(1, 30))] for _ in range(8)]  # shared prefixes likely
    live: list[list[int]] = []
    hits = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.5 and live:
            idx.release(live.pop(rng.randrange(len(live))))
        elif op < 0.55:
            idx.invalidate()
        else:
            toks = rng.choice(prompts) + [rng.randrange(5) for _ in range(rng.randint(0, 9))]
            hashes = block_hashes(toks, B)
            hit = idx.match(hashes)
            hits += bool(hit)
            blocks = list(hit.blocks) if hit else []
            need = -(-len(toks) // B) - len(blocks)
            if need > idx.num_available:
                idx.release(blocks)
                continue
            blocks += [idx.allocate() for _ in range(need)]
            for blk, h in list(zip(blocks, hashes, strict=False))[len(hit.blocks) if hit else 0:]:
                idx.publish(blk, h)
            if hashes:
                idx.snapshot_slot(hashes[-1])
            if hit:  # what a hit returns is the prefix it names
                assert [idx.hash_of.get(b) for b in hit.blocks] == hashes[:len(hit.blocks)]
            live.append(blocks)
        idx.check()
    for blocks in live:
        idx.release(blocks)
    idx.check()
    assert idx.num_available == 39 and not idx.refs and hits > 0 and idx.evictions > 0


def test_prefix_router_follows_cached_prefixes_within_a_load_bound():
    from mtp_ray.runtime.prefix_routing import PrefixRouter

    router = PrefixRouter(block_size=B, lookahead=1, slack=2)
    system = list(range(50, 70))
    assert router.pick(system + [1, 2], [0, 0]) == 0
    assert router.pick([9] * 12, [1, 0]) == 1  # nothing remembered: the least-loaded rank
    assert router.pick(system + [3, 4, 5], [1, 1]) == 0  # same system prompt: where its blocks are
    assert router.pick(system + [6], [3, 1]) == 0  # 2 more in flight there: still within the slack
    assert router.pick(system + [7], [4, 1]) == 1  # 3 more: by load (and now remembered on rank 1)
    assert router.pick(system + [8], [2, 2]) == 1
    assert router.routed_by_prefix == 2  # the picks where the prefix overruled the load
