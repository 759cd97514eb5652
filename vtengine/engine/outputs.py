"""What the engine returns, shaped like vLLM's ``RequestOutput``/``CompletionOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None     # "length" | "stop" | "abort" | None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    new_token_ids: list[int] = field(default_factory=list)   # tokens produced by the step that returned this
    prompt: str | None = None
