"""PrefixRouter (pure Python): the group's cache-aware choice of rank when prefix caching is on.

Each rank caches the prefixes it computed, so a request whose prompt starts like an earlier one's should go to the
same rank. The group remembers, per block name (the ranks' own `block_hashes`), the rank it last sent that prefix
to (bounded, least recently used first out), and sends a request to the rank holding its longest remembered
prefix unless that rank has `slack` more requests than the least-loaded one (so one hot prefix does not pile
everything on one rank). Only the choice of rank changes: the lock-step protocol does not see it.
"""

from __future__ import annotations

from collections import OrderedDict

from mtp_ray.config.engine import EngineConfig
from mtp_ray.engine.prefix_cache import BlockHash, prompt_block_names


class PrefixRouter:
    def __init__(self, block_size: int, lookahead: int, slack: int, capacity: int = 1 << 16):
        self.block_size, self.lookahead, self.slack, self.capacity = block_size, lookahead, slack, capacity
        self.owner: OrderedDict[BlockHash, int] = OrderedDict()  # block name -> the rank it was last sent to
        self.routed_by_prefix = 0  # requests sent to a rank for its cached prefix rather than by load

    def pick(self, prompt: list[int], load: list[int], salt: str | None = None) -> int:
        """The rank for a new request, given each rank's requests in flight (salt: its cache_salt); remembers the
        choice."""
        hashes = prompt_block_names(prompt, self.block_size, self.lookahead, salt)  # what the rank will look up
        least = min(range(len(load)), key=lambda r: load[r])
        rank = least
        for h in reversed(hashes):  # the longest remembered prefix
            r = self.owner.get(h)
            if r is not None and r < len(load):
                if r != least and load[r] <= load[least] + self.slack:
                    rank = r
                    self.routed_by_prefix += 1
                break
        for h in hashes:
            self.owner[h] = rank
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)
        return rank


def rank_router(cfg: EngineConfig) -> PrefixRouter | None:
    """A group's cache-aware rank choice (prefix caching on, more than one rank); None: the least-loaded rank."""
    if not cfg.cache.prefix_caching or cfg.parallel.dp == 1:
        return None
    return PrefixRouter(cfg.cache.block_size, int(cfg.spec.k > 0), slack=max(2, cfg.scheduler.max_num_seqs // 4))
