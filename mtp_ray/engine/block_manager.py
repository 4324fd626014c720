"""KV block and GDN state-slot bookkeeping (pure Python). Block 0 and slot 0 are reserved for dummy / padded rows."""

from __future__ import annotations

from collections import deque

from mtp_ray.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, slots_per_seq: int):
        assert num_blocks >= 2 and num_state_slots >= 1 + slots_per_seq
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slots_per_seq = slots_per_seq  # main slot + k+1 speculative snapshot slots
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.free_slots: deque[int] = deque(range(1, num_state_slots))

    def usage(self) -> float:
        """The share of KV blocks held by sequences (block 0, the dummy block, not counted)."""
        return 1.0 - len(self.free_blocks) / (self.num_blocks - 1)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_hold(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - len(req.block_ids)
        slots = 0 if req.state_slots else self.slots_per_seq
        return need <= len(self.free_blocks) and slots <= len(self.free_slots)

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Give req blocks for positions [0, num_tokens) and its state slots; all or nothing."""
        if not self.can_hold(req, num_tokens):
            return False
        while len(req.block_ids) < self.blocks_for(num_tokens):
            req.block_ids.append(self.free_blocks.popleft())
        if not req.state_slots:
            req.state_slots = [self.free_slots.popleft() for _ in range(self.slots_per_seq)]
        return True

    def free(self, req: Request) -> None:
        self.free_blocks.extend(req.block_ids)
        self.free_slots.extend(req.state_slots)
        req.block_ids = []
        req.state_slots = []

    def slot_of(self, req: Request, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def check(self, live: list[Request]) -> None:
        """Invariant: every block / slot is free or owned by exactly one live request."""
        owned = [b for r in live for b in r.block_ids]
        assert len(owned) == len(set(owned)) and not set(owned) & set(self.free_blocks)
        assert len(owned) + len(self.free_blocks) == self.num_blocks - 1
        slots = [s for r in live for s in r.state_slots]
        assert len(slots) == len(set(slots)) and not set(slots) & set(self.free_slots)
