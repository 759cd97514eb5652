"""A request's token sequence, its place in the paged KV cache, and when things happened to it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from itertools import count

from vtengine.engine.sampling_params import SamplingParams


PENDING = -1                    # a token sampled on the device by a step still in flight (async scheduling)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceTimes:
    """When things happened to one request, in ``time.perf_counter()`` seconds (comparable within one process).

    Stamped by the engine (``LLMEngine.add_request`` and ``step``); read by the server once the request finished,
    which turns them into the latency histograms of ``vtengine/metrics.py``. Every token of one step gets that
    step's end time: the moment its token existed on the host."""
    arrival: float                          # the request arrived (the server passes its HTTP arrival time)
    first_scheduled: float | None = None    # the start of the first step that ran it (its prefill)
    token_times: list[float] = field(default_factory=list)      # one per generated token
    finished: float | None = None           # its last token (stop or length); None while running or when aborted

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled: time spent waiting for a batch slot and KV blocks."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        """Arrival to the first generated token."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        """Arrival to the last token."""
        return None if self.finished is None else self.finished - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        """The gap before every token but the first (one per token: a preemption's wait shows as one long gap)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Sequence:
    _ids = count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 arrival_time: float | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)      # prompt + completion: what a recompute re-prefills
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_cached_tokens = 0                   # tokens whose K/V are in the cache
        self.num_new_tokens = 0                      # tokens the scheduled step computes (a prefill chunk, or 1)
        self.in_prefill = False                      # admitted, its prompt (or recompute) not all in the cache yet
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.times = SequenceTimes(time.perf_counter() if arrival_time is None else arrival_time)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated tokens known on the host (up to the first one still in flight)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens, those still in flight included (what positions and limits count)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    # -- async scheduling: a position holds PENDING from the launch of the step that samples it to its collection
    @property
    def has_pending(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] == PENDING

    @property
    def num_pending(self) -> int:
        """Positions still in flight: at most two, always the last (one step launched, the next launched before
        the first was read)."""
        return sum(t == PENDING for t in self.token_ids[-2:])

    def last_known_token(self) -> int:
        """The newest token the host holds (what a step reading host ids sees while one is in flight)."""
        return self.token_ids[len(self.token_ids) - self.num_pending - 1]

    def add_pending(self) -> None:
        self.token_ids.append(PENDING)

    def resolve_pending(self, token_id: int) -> None:
        """The oldest in-flight position gets its sampled token."""
        self.token_ids[len(self.token_ids) - self.num_pending] = token_id

    @property
    def prefill_remaining(self) -> int:
        """Tokens still to prefill before the sequence samples (0 once it decodes)."""
        return len(self.token_ids) - self.num_cached_tokens if self.in_prefill else 0

    @property
    def samples_this_step(self) -> bool:
        """Whether the scheduled step samples a token for this sequence: a decode step, or the prefill step of its
        last chunk (read before the step runs: the runner then advances num_cached_tokens)."""
        return not self.in_prefill or self.num_cached_tokens + self.num_new_tokens >= len(self.token_ids)

    @property
    def num_blocks_needed(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
