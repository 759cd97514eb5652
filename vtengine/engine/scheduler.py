"""Continuous batching: each step is either a prefill batch (new or preempted sequences) or a decode batch.

Prefill has priority (it admits waiting sequences while there are KV blocks, sequence slots and token budget);
otherwise every running sequence decodes one token. A prompt longer than the token budget (max_num_batched_tokens)
is prefilled in chunks over several steps, so a long max_model_len never makes a step larger than the budget; a
sequence samples its first token in the step that prefills its last chunk. When the KV pool cannot hold the next
token of a running sequence, the most recently admitted sequence is preempted by recompute: its blocks are freed and
it goes back to the front of the waiting queue with prompt + generated tokens, to be re-prefilled later (vLLM's
RECOMPUTE mode).

The lever chunked_prefill (N tokens) changes the priority: a prefill step carries at most N tokens (the last
sequence it admits may take a partial chunk), and while sequences are decoding, a decode step runs between every
two prefill steps. A long prompt then costs each decoding sequence at most one N-token chunk per token, instead of
its whole prefill (here each step keeps its own kernels, so a decode step is the same graphed step, bit for bit,
whether or not a prefill is under way).

The lever mixed_steps fuses the two, as vLLM's unified token budget does: every running sequence's decode token and
the prefill tokens ride in one step (one read of every weight), decode tokens first, then prefill chunks up to the
chunk size (chunked_prefill N) or, without it, up to max_num_batched_tokens less the decode tokens. The step's
sequences are ordered prefill first, decode after (the model runner lays the batch out that way). A step with no
prefill work left is a plain decode step (graphed). Decode rows then share GEMMs with prefill rows, so their
arithmetic (and a near tie's token) may differ from a decode step's.

The lever chunk_above (T tokens) narrows chunking to long prompts: with chunked_prefill N, a waiting prompt of at
most T tokens is admitted whole (when it fits what is left of max_num_batched_tokens, less the step's decode tokens),
as prefill first admits it, and only longer prompts share the N-token chunk budget. Equal short prompts that arrive
together then prefill together and stay in step, as they do without chunking, while a long prompt still costs each
decoding sequence at most one N-token chunk per token.

The lever whole_first keeps them in step when they arrive a step apart, as closed-loop clients of equal requests do
once any of them is a step ahead. With mixed steps alone, the running sequences' decode tokens ride in the step that
prefills a newcomer's whole prompt: the sequence admitted a step earlier gains a token on the newcomer, finishes a
step before it, and its successor arrives a step before the newcomer's, so the two never prefill together again (on
the H200, 2026-12-04, 1k prompts at c = 2: 6 prefill steps for 6 requests where prefill first took 4, TTFT x1.5 and
total tok/s x0.97). With whole_first, a mixed step whose prefill work is whole prompts only (no prompt under way in
chunks, none admitted in part) runs as prefill first runs it: the decoding sequences wait that one step, never two
steps in a row, and the KV blocks their next tokens need stay free. Chunks of long prompts still carry every decode
token.
"""
from __future__ import annotations

from collections import deque

from vtengine import counters
from vtengine.engine.block_manager import BlockManager
from vtengine.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_seq_tokens: int | None = None, prefill_chunk: int | None = None, mixed_steps: bool = False,
                 chunk_above: int | None = None, whole_first: bool = False):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seq_tokens = max_seq_tokens
        self.prefill_chunk = prefill_chunk          # the lever chunked_prefill (None: off)
        self.mixed_steps = mixed_steps              # the lever mixed_steps
        self.chunk_above = chunk_above              # the lever chunk_above (None: off)
        self.whole_first = whole_first              # the lever whole_first
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._last_was_prefill = False
        self._held_last = False                     # whole_first: the last step held decode tokens back

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (sequences to run this step, is_prefill). Each scheduled sequence's ``num_new_tokens`` says how
        many of its tokens the step computes (a prefill chunk, or 1 when decoding). A mixed step (mixed_steps) is
        returned as a prefill step whose sequences are its prefill chunks first, then its decoding sequences."""
        if self.mixed_steps:
            return self._schedule_mixed()
        decoding = any(not s.in_prefill for s in self.running)
        if self.prefill_chunk and decoding and self._last_was_prefill:
            scheduled = self._schedule_decode()         # chunked_prefill: a decode step between two prefill steps
            if scheduled:
                self._last_was_prefill = False
                return scheduled, False
        scheduled = self._schedule_prefill()
        self._last_was_prefill = bool(scheduled)
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_mixed(self) -> tuple[list[Sequence], bool]:
        held_last, self._held_last = self._held_last, False
        if self.whole_first and not held_last and not any(s.in_prefill for s in self.running):
            # whole_first: whole prompts at the head of the queue prefill first, the decoding sequences wait a step
            # (never two in a row: a stream of short prompts would starve them); the blocks their next tokens need
            # stay free, or the next step would preempt the prompt just prefilled
            held = [s for s in self.running if self._wants_token(s)]
            reserve = sum(max(s.num_blocks_needed - len(s.block_table), 0) for s in held)
            prefill = self._schedule_prefill(whole_only=True, reserve=reserve)
            if prefill:
                if held:        # the mechanism gate's proof: decode tokens held back for a whole prompt's step
                    counters.record("whole_first", "waited", grid=(len(held),))
                    self._held_last = True
                return prefill, True
        preemptions = self.num_preemptions
        decode = self._schedule_decode()
        room = max(0, self.max_num_batched_tokens - len(decode))
        # a preemption just now means the pool is full: no admission in this step (the preempted sequence would be
        # re-admitted at once); prompts already under way still take their chunks
        prefill = self._schedule_prefill(room, admit=self.num_preemptions == preemptions)
        if not prefill:
            return decode, False
        return prefill + decode, True

    def _schedule_prefill(self, room: int | None = None, admit: bool = True, whole_only: bool = False,
                          reserve: int = 0) -> list[Sequence]:
        """The step's prefill sequences. ``room``: the tokens the step may take (max_num_batched_tokens, less a mixed
        step's decode tokens). Chunks take chunked_prefill's N (without it, the room); whole short prompts
        (chunk_above) what the room has left. ``whole_only`` (whole_first): admit waiting prompts only while each
        goes in this step whole, first come, first served, leaving ``reserve`` KV blocks free."""
        room = self.max_num_batched_tokens if room is None else room
        budget = self.prefill_chunk or room         # what chunks may take (chunked_prefill's N, even past the room)
        whole_max = None        # chunk_above: whole up to T, never past the step budget (it would wait for ever)
        if self.prefill_chunk and self.chunk_above:
            whole_max = min(self.chunk_above, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        for seq in self.running:                    # chunks of prompts already under way come first, oldest first
            if seq.in_prefill and budget > 0:
                seq.num_new_tokens = min(seq.prefill_remaining, budget)
                budget -= seq.num_new_tokens
                room -= seq.num_new_tokens
                scheduled.append(seq)
        admitted: list[Sequence] = []
        while admit and self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            need = len(seq)
            whole = whole_max is not None and need <= whole_max
            if whole:
                # chunk_above: a short prompt goes whole or waits its turn (first come, first served)
                if need > room:
                    break
            elif budget <= 0:
                break
            # Without chunked_prefill a prompt is admitted whole when it fits what is left of the budget; one longer
            # than the whole budget is admitted alone and chunked. With it, the last admitted takes what is left.
            elif need > budget and not self.prefill_chunk and (scheduled or admitted):
                break
            if whole_only and not whole and need > min(budget, room):
                break
            if self.block_manager.num_free - reserve < seq.num_blocks_needed:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            seq.in_prefill = True
            seq.num_new_tokens = need if whole else min(need, budget)
            if not whole:
                budget -= seq.num_new_tokens
            room -= seq.num_new_tokens
            if whole_max is not None and need > self.prefill_chunk:     # chunk_above's proof: a prompt longer
                counters.record("chunk_above", "whole" if whole else "chunked", grid=(need,))   # than N, whole?
            admitted.append(seq)
        self.running.extend(admitted)
        scheduled += admitted
        if scheduled:       # the mechanism gate's proof of chunked_prefill: which policy shaped the prefill step
            counters.record("prefill_step", f"chunk={self.prefill_chunk}" if self.prefill_chunk else "prefill_first",
                            grid=(sum(s.num_new_tokens for s in scheduled),))
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        resting = []                        # sequences still prefilling, and (async scheduling) sequences whose
        while self.running:                 # last token is still in flight at their length limit: no decode now
            seq = self.running.popleft()
            if seq.in_prefill or not self._wants_token(seq):
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
                seq.num_new_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled + resting))
        return scheduled

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
        seq.in_prefill = False
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
