"""Continuous batching: each step is either a prefill batch (new or preempted sequences) or a decode batch.

Prefill has priority (it admits waiting sequences while there are KV blocks, sequence slots and token budget);
otherwise every running sequence decodes one token. When the KV pool cannot hold the next token of a running
sequence, the most recently admitted sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the waiting queue with prompt + generated tokens, to be re-prefilled later (vLLM's RECOMPUTE mode).
"""
from __future__ import annotations

from collections import deque

from vtengine.engine.block_manager import BlockManager
from vtengine.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_seq_tokens: int | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seq_tokens = max_seq_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (sequences to run this step, is_prefill)."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + len(seq) > self.max_num_batched_tokens or not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            num_tokens += len(seq)
            scheduled.append(seq)
        if scheduled:
            self.running.extend(scheduled)
            return scheduled, True

        resting = []                        # async scheduling: sequences whose last token is still in flight and
        while self.running:                 # at their length limit; they finish when it is read, not decode again
            seq = self.running.popleft()
            if not self._wants_token(seq):
                resting.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled + resting))
        return scheduled, False

    def _wants_token(self, seq: Sequence) -> bool:
        """Whether a running sequence may decode another token: below max_tokens and the length limit, counting
        the tokens of a step still in flight (always true for a synchronous engine, which has none in flight)."""
        if not seq.has_pending:
            return True
        if seq.num_completion_tokens >= seq.params.max_tokens:
            return False
        return self.max_seq_tokens is None or len(seq) < self.max_seq_tokens

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.block_table:
            self.block_manager.free(seq)
        for queue in (self.running, self.waiting):      # waiting: preempted while its last token was in flight
            if seq in queue:
                queue.remove(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    if seq.block_table:
                        self.block_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None
