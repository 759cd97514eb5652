"""Per-request sampling parameters, mirroring vLLM's ``SamplingParams``.

``__post_init__`` checks the object's own invariants (ranges the sampler relies on), whoever builds it: the offline
API, the CLI, or the server's protocol module. Checking what a JSON request may contain (types, NaN, the model's
context length and vocabulary) is ``vtengine/protocol.py``'s job; it builds a ``SamplingParams`` only from values of
the right type, and reports a violated invariant with the ``param`` this module attaches to the error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request is invalid (the server answers 400 with this message). ``param`` names the offending field where
    there is one (a ``SamplingParams`` field name here; the protocol maps it to the request's own name)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS): dividing fp32 logits by a temperature under
# ~1e-38 gave inf, a NaN softmax and token 0 every time; between, the distribution is a point mass anyway.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0        # 0 (or below SAMPLING_EPS) means greedy
    top_k: int = -1                 # -1 or 0: disabled
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        for name in ("temperature", "top_p"):
            # NaN passes every comparison below, and an infinite temperature divides the logits to zero: neither is
            # a distribution anyone asked for
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be a finite number, got {getattr(self, name)!r}", name)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if self.top_k is None:
            self.top_k = -1
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):
            # torch.Generator.manual_seed's range: past it, seeding would raise on the engine thread
            raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}", "seed")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1
