"""Per-request sampling parameters, mirroring vLLM's ``SamplingParams``."""
from __future__ import annotations

from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request is invalid (the server answers 400 with this message)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0        # 0 means greedy
    top_k: int = -1                 # -1 or 0: disabled
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is None:
            self.top_k = -1
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("temperature", "top_p"):
            if getattr(self, name) != getattr(self, name):          # NaN passes every comparison below
                raise RequestError(f"{name} must be a number, got NaN")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
