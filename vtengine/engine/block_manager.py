"""Paged KV-cache block allocation with reference counts (a block may be shared by sequences that fork)."""
from __future__ import annotations

from collections import deque

from vtengine.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def _take(self) -> int:
        block = self.free_ids.popleft()
        assert self.ref_counts[block] == 0, f"block {block} is on the free list with refs"
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
        if self.ref_counts[block] == 0:
            self.free_ids.append(block)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free >= seq.num_blocks_needed

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of the sequence (a prefill, or a re-prefill after preemption)."""
        assert not seq.block_table, "sequence already holds blocks"
        seq.block_table = [self._take() for _ in range(seq.num_blocks_needed)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's blocks (copy-on-write is the caller's business: only full blocks should be shared)."""
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Room for the K/V of the token about to be decoded (position len(seq) - 1)."""
        return self.num_free >= max(seq.num_blocks_needed - len(seq.block_table), 0)

    def append_slot(self, seq: Sequence) -> None:
        """Make sure the block for position len(seq) - 1 (the token about to be decoded) exists."""
        while len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self._take())
