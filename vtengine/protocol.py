"""The OpenAI request protocol: a request body parsed ONCE into token-id prompts and ``SamplingParams``, or an
``ApiError`` that names the bad field.

As in vLLM's ``entrypoints/openai/protocol.py``, nothing past this module reads the raw body: ``serving.py`` gets a
``CompletionRequest`` and the engine gets prompts and params that are already valid.

Who checks what (each fact in one place):

    here              the JSON itself (decodable, nested less deep than Python's recursion limit, an object at the
                      top), each field's JSON type, options we do not support, prompt shapes, token ids against the
                      vocabulary, prompt + max_tokens against the context length
    SamplingParams    its own invariants (max_tokens >= 1, finite temperature >= 0, top_p in (0, 1], top_k >= -1,
                      the seed range torch accepts); its ``RequestError.param`` becomes the error's ``param`` here
    the engine        nothing a request can reach: ``LLMEngine.add_request`` keeps its own guards for the offline API

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``; ``param`` is set by the check that
failed (never guessed from the message) and names the request's field, e.g. ``max_completion_tokens`` rather than
the ``max_tokens`` it becomes.
"""
from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass
from typing import Any

from vtengine.engine.sampling_params import RequestError, SamplingParams

MAX_BODY_BYTES = 32 * 2**20     # 413 above this: ~4M token ids as JSON, far past any context we serve


class ApiError(Exception):
    """An OpenAI-style error: the server turns it into {"error": {...}} with this status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ModelSpec:
    """What parsing needs to know about the served model."""
    name: str
    max_model_len: int          # prompt + completion tokens (already capped by what the KV pool holds)
    vocab_size: int             # token ids must lie in [0, vocab_size)
    tokenizer: Any              # encode(str) -> ids; chat_template / apply_chat_template for chat


@dataclass
class CompletionRequest:
    """A parsed /v1/completions or /v1/chat/completions body: one prompt and one SamplingParams per choice."""
    chat: bool
    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool


# ---------------------------------------------------------------------------------------------------------------
# the body


def parse_json(raw: bytes, *, empty_ok: bool = False) -> Any:
    """The JSON value of a request body (None for an empty body when ``empty_ok``). Python's json module accepts
    NaN and +-Infinity (the fields that take numbers reject them) and raises on two inputs besides syntax errors,
    both answered here with a 400 rather than a 500: nesting deeper than the recursion limit, and integers longer
    than Python's int/str conversion limit (kept as ``HugeInt`` so the field check names the field)."""
    if empty_ok and not raw.strip():
        return None
    try:
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise
        except ValueError:      # "Exceeds the limit (4300 digits) for integer string conversion": parse again,
            return json.loads(raw, parse_int=_parse_int)      # slower, keeping the long ones as HugeInt
    except RecursionError:
        key = _key_where_too_deep(raw)
        where = f"{key} is" if key else "the request body is"
        raise ApiError(f"{where} nested too deeply to parse (arrays/objects nested past Python's recursion limit, "
                       f"about a thousand levels)", param=key, code="invalid_json") from None
    except ValueError as e:     # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(f"request body is not valid JSON: {e}", code="invalid_json") from None


def parse_object(raw: bytes) -> dict:
    """A request body that must be a JSON object (the completions endpoints)."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    return body


class HugeInt:
    """An integer literal too long for Python's int(): no field accepts it, and the field's check says which."""

    def __init__(self, digits: str):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a {len(self.digits.lstrip('-'))}-digit integer>"


def _parse_int(s: str) -> int | HugeInt:
    try:
        return int(s)
    except ValueError:
        return HugeInt(s)


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')


def _key_where_too_deep(raw: bytes) -> str | None:
    """The top-level key whose value nests deepest (None when the body is not an object): the error's ``param``.
    A scan of the raw bytes, run only after json.loads gave up, so its cost never touches a good request."""
    depth, deepest, key, culprit, last_string = 0, 0, None, None, None
    for m in _TOKEN.finditer(raw):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest, culprit = depth, key
        elif tok in (b"]", b"}"):
            depth -= 1
        elif tok == b":":
            if depth == 1 and last_string is not None:       # "key": at the top level of an object
                try:
                    key = json.loads(last_string)
                except ValueError:
                    key = None
        else:
            last_string = tok
            continue
        last_string = None
    return culprit


# ---------------------------------------------------------------------------------------------------------------
# the request


def parse_completion_request(body: dict, model: ModelSpec, *, chat: bool) -> CompletionRequest:
    """A completions (``chat=False``) or chat-completions body -> CompletionRequest, or ApiError."""
    _check_model(body, model)
    _check_unsupported(body)
    stream, include_usage = _stream_flags(body)
    if chat:
        prompts = [_chat_prompt(body, model)]
        default_max_tokens = None           # chat: what fits in the context (as OpenAI does)
    else:
        prompts = _prompts(body, model)
        default_max_tokens = 16             # completions: OpenAI's default
    fields = _sampling_fields(body, model)
    params = [_params(fields, len(p), default_max_tokens, model, "messages" if chat else "prompt") for p in prompts]
    return CompletionRequest(chat=chat, prompts=prompts, params=params, stream=stream, include_usage=include_usage)


def _check_model(body: dict, model: ModelSpec) -> None:
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise ApiError(f"model must be a string, got {_short(name)}", param="model")
    if name != model.name:
        raise ApiError(f"The model {name!r} does not exist; this server serves {model.name!r}",
                       status=404, param="model", code="model_not_found")


def _off(v: Any) -> bool:
    return v is None or v is False or (isinstance(v, (list, dict, str)) and not v)


def _zero(v: Any) -> bool:
    return v is None or (_is_number(v) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (_is_number(v) and v == 1)


# Options that would change the output if honoured: rejected, never silently ignored. Fields not listed here and not
# read below (user, metadata, ...) are ignored, as vLLM does. (field, accepted when, what is accepted)
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("n", lambda v: v is None or (_is_int(v) and v == 1), "1 (one completion per prompt) or absent"),
    ("best_of", lambda v: v is None or (_is_int(v) and v == 1), "1 or absent"),
    ("logprobs", lambda v: _off(v) or (_is_int(v) and v == 0), "absent, null, false or 0 (logprobs are not served)"),
    ("top_logprobs", lambda v: _off(v) or (_is_int(v) and v == 0), "absent or 0 (logprobs are not served)"),
    ("echo", _off, "absent or false"),
    ("suffix", _off, "absent (insertion is not supported)"),
    ("stop", _off, "absent (stop strings are not supported; use stop_token_ids)"),
    ("logit_bias", _off, "absent or {}"),
    ("tools", _off, "absent or [] (tool calls are not supported)"),
    ("functions", _off, "absent or [] (function calls are not supported)"),
    ("presence_penalty", _zero, "0 or absent (penalties are not supported)"),
    ("frequency_penalty", _zero, "0 or absent (penalties are not supported)"),
    ("repetition_penalty", _one, "1 or absent (penalties are not supported)"),
    ("min_p", _zero, "0 or absent"),
    ("min_tokens", _zero, "0 or absent"),
    ("response_format", lambda v: v is None or v == {"type": "text"}, 'absent or {"type": "text"}'),
)


def _check_unsupported(body: dict) -> None:
    for name, accepted, what in _UNSUPPORTED:
        if name in body and not accepted(body[name]):
            raise ApiError(f"{name} must be {what}, got {_short(body[name])}", param=name)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise ApiError(f"stream_options must be an object, got {_short(opts)}", param="stream_options")
    if not stream:
        raise ApiError("stream_options is only allowed with stream=true", param="stream_options")
    return stream, _bool(opts, "include_usage", False, param="stream_options.include_usage")


def _prompts(body: dict, model: ModelSpec) -> list[list[int]]:
    """OpenAI's four prompt shapes (a string, a list of strings, a list of token ids, a list of token-id lists) ->
    a list of token-id lists."""
    p = body.get("prompt")
    if p is None:
        raise ApiError("prompt is required: a string, a list of strings, a list of token ids, or a list of "
                       "token-id lists", param="prompt")
    if isinstance(p, str):
        batch: list = [p]
    elif isinstance(p, list) and p and all(_is_int(x) for x in p):
        batch = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        batch = p
    else:
        raise ApiError(f"prompt must be a non-empty string, list of strings, list of token ids or list of "
                       f"token-id lists; got {_short(p)}", param="prompt")
    batched = batch is p
    out = []
    for i, item in enumerate(batch):
        where = f"prompt[{i}]" if batched else "prompt"
        if isinstance(item, str):
            if not item:
                raise ApiError(f"{where} is an empty string", param="prompt")
            ids = _encode(model.tokenizer, item, where)
        else:
            ids = _token_ids(item, where, "prompt", model.vocab_size)
        if not ids:
            raise ApiError(f"{where} has no tokens", param="prompt")
        out.append(ids)
    return out


def _chat_prompt(body: dict, model: ModelSpec) -> list[int]:
    if not getattr(model.tokenizer, "chat_template", None):
        raise ApiError(f"model {model.name!r} has no chat template; use /v1/completions",
                       param="messages", code="chat_template_missing")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(f"messages must be a non-empty list of {{role, content}} objects, got {_short(msgs)}",
                       param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ApiError(f"messages[{i}] must be {{'role': 'system'|'user'|'assistant', 'content': str}}, "
                           f"got {_short(m)}", param="messages")
    try:
        ids = list(model.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]}
                                                        for m in msgs]))
    except Exception as e:      # the template's own raise_exception (e.g. roles out of order), a lone surrogate
        raise ApiError(f"messages cannot be rendered with the chat template: {e}", param="messages") from None
    if not ids:
        raise ApiError("messages rendered to an empty prompt", param="messages")
    return ids


@dataclass
class _SamplingFields:
    """The sampling fields of a body, type-checked; ranges are SamplingParams' to check."""
    max_tokens: int | None
    max_tokens_name: str        # the request's name for it: max_tokens or max_completion_tokens
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool
    stop_token_ids: list[int]


def _sampling_fields(body: dict, model: ModelSpec) -> _SamplingFields:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None and not _is_int(max_tokens):
        raise ApiError(f"{name} must be an integer >= 1, got {_short(max_tokens)}", param=name)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list):
        raise ApiError(f"stop_token_ids must be a list of token ids, got {_short(stop_ids)}", param="stop_token_ids")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(f"seed must be an integer, got {_short(seed)}", param="seed")
    return _SamplingFields(
        max_tokens=max_tokens, max_tokens_name=name,
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        top_k=_int(body, "top_k", -1),
        seed=seed,
        ignore_eos=_bool(body, "ignore_eos", False),
        stop_token_ids=_token_ids(stop_ids, "stop_token_ids", "stop_token_ids", model.vocab_size),
    )


def _params(f: _SamplingFields, prompt_len: int, default_max_tokens: int | None, model: ModelSpec,
            prompt_param: str = "prompt") -> SamplingParams:
    """One prompt's SamplingParams: max_tokens defaulted (to at most the room the prompt leaves: a request that did
    not send max_tokens is not told to reduce it) and checked against that room. ``prompt_param``: the field the
    prompt came from ("messages" for chat)."""
    room = model.max_model_len - prompt_len
    if room < 1:
        raise ApiError(f"This model's maximum context length is {model.max_model_len} tokens; the prompt has "
                       f"{prompt_len} tokens, leaving no room for a completion", param=prompt_param,
                       code="context_length_exceeded")
    name, max_tokens = f.max_tokens_name, f.max_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if prompt_len + max_tokens > model.max_model_len:
        raise ApiError(f"This model's maximum context length is {model.max_model_len} tokens; you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                       f"completion). Reduce the prompt or {name}.", param=name, code="context_length_exceeded")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=f.temperature, top_p=f.top_p, top_k=f.top_k,
                              seed=f.seed, ignore_eos=f.ignore_eos, stop_token_ids=list(f.stop_token_ids))
    except RequestError as e:
        # SamplingParams names its own field; the request may have called it max_completion_tokens
        param = name if e.param == "max_tokens" else e.param
        raise ApiError(str(e).replace("max_tokens", name, 1) if e.param == "max_tokens" else str(e),
                       param=param) from None


# ---------------------------------------------------------------------------------------------------------------
# field helpers: each names the field, the bad value and what is accepted


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise ApiError(f"{name} must be a number, got {_short(v)}", param=name)
    try:
        return float(v)
    except OverflowError:       # an integer past float's range (1e309 as a JSON float is already inf)
        raise ApiError(f"{name} must be a finite number, got {_short(v)}", param=name) from None


def _int(body: dict, name: str, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise ApiError(f"{name} must be an integer, got {_short(v)}", param=name)
    return v


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{param or name} must be true or false, got {_short(v)}", param=param or name)
    return v


def _token_ids(ids: list, where: str, param: str, vocab_size: int) -> list[int]:
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise ApiError(f"{where}[{i}] = {_short(t)} is not a token id; accepted: integers in [0, {vocab_size})",
                           param=param)
    return list(ids)


def _encode(tokenizer: Any, text: str, where: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except (UnicodeError, ValueError) as e:     # e.g. a lone surrogate ("\ud800") that UTF-8 cannot encode
        raise ApiError(f"{where} cannot be tokenized: {e}", param="prompt") from None


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 3, 8, 4, 60, 60


def _short(v: Any) -> str:
    """A bounded repr for messages: never the whole of a huge or deeply nested value."""
    return _repr.repr(v)


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")
