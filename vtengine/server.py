"""``vtengine serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncEngine``.

Endpoints
    POST /v1/completions        prompt: text, token ids, or a batch of either; max_tokens (default 16), temperature
                                (default 1.0), top_p, top_k, seed, ignore_eos, stop_token_ids, stream,
                                stream_options.include_usage
    POST /v1/chat/completions   messages (role/content strings), when the tokenizer has a chat template;
                                max_tokens or max_completion_tokens (default: what fits in max_model_len)
    GET  /v1/models             the served model, with non-standard ``max_model_len`` and ``vocab_size`` fields
    GET  /health                200 while the engine thread is alive, 503 after it died
    GET  /metrics               Prometheus text: requests running/waiting, KV blocks, token and request counters,
                                engine step time, kernel route counters, peak GPU memory, and two info series:
                                every lever's resolved value and source (vtengine_lever_info) and what the server
                                runs (vtengine_build_info: model, quant, dtype, device, torch, triton)
    POST /debug/fault           only with --fault-injection (campaign servers): {"kind": ..., ...} sets a deliberate
                                fault of vtengine/faults.py (a gate's self-check), {} or null mends it

Streaming follows OpenAI's SSE format (``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``) with ONE chunk per generated
token, so a client's chunk gaps are inter-token latencies (``vllm bench serve`` counts them that way). The chunk
that carries a sequence's last token also carries its ``finish_reason``. With ``stream_options.include_usage`` a
last chunk with ``choices: []`` and exact ``usage`` precedes ``[DONE]``; non-streaming responses always carry usage.

Non-standard field: every choice (streamed chunk or full response) has ``token_ids``, the generated token ids
(in a chunk: the one new token), for token-exact comparisons that text cannot give.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (malformed
JSON, bad field types or values, prompt too long, token ids outside the vocabulary, n > 1, unsupported options),
404 for an unknown model or route, 503 when the engine is dead; the server keeps serving after any of them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
import uuid
from typing import Any, AsyncIterator

from vtengine import counters
from vtengine.engine.async_engine import AsyncEngine, EngineDeadError
from vtengine.engine.sampling_params import RequestError, SamplingParams

try:        # the server stack is optional for the offline engine; fail with a message, not an ImportError trace
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:      # pragma: no cover
    raise ImportError(f"vtengine serve needs fastapi and uvicorn ({e}); pip install fastapi uvicorn") from None


# ---------------------------------------------------------------------------------------------------------------
# errors


class ApiError(Exception):
    """An OpenAI-style error: the handler turns it into {"error": {...}} with this status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


def _request_error(e: RequestError) -> ApiError:
    # SamplingParams/engine messages start with the field's name ("max_tokens must be ..."): point param at it.
    first = str(e).split(" ", 1)[0]
    return ApiError(str(e), param=first if first in _SAMPLING_FIELDS + ("prompt",) else None)


# ---------------------------------------------------------------------------------------------------------------
# request parsing: every check names the field, the bad value and what is accepted


def _number(body: dict, name: str, default: Any, kind: type, lo: float | None = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok:
        raise ApiError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {v!r}", param=name)
    if lo is not None and v < lo:
        raise ApiError(f"{name} must be >= {lo}, got {v!r}", param=name)
    return kind(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{name} must be true or false, got {v!r}", param=name)
    return v


def _check_unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ApiError(f"n must be 1 (one completion per prompt is supported), got {n!r}", param="n")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise ApiError(f"best_of must be 1 or absent, got {best_of!r}", param="best_of")
    for name in ("logprobs", "top_logprobs", "suffix", "tools", "logit_bias"):
        if body.get(name) not in (None, False, {}, []):
            raise ApiError(f"{name} is not supported by vtengine serve, got {body[name]!r}", param=name)
    if body.get("echo"):
        raise ApiError("echo=true is not supported by vtengine serve", param="echo")
    if body.get("stop") not in (None, "", []):
        raise ApiError(f"stop strings are not supported (use stop_token_ids), got {body['stop']!r}", param="stop")
    if body.get("presence_penalty") not in (None, 0, 0.0) or body.get("frequency_penalty") not in (None, 0, 0.0):
        raise ApiError("presence_penalty and frequency_penalty are not supported (must be 0 or absent)",
                       param="presence_penalty" if body.get("presence_penalty") else "frequency_penalty")


class Server:
    """The app's state: the async engine plus what the handlers need to know about the model."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, tokenizer: Any, max_model_len: int,
                 vocab_size: int, tokenizer_vocab_size: int | None = None, fault_injection: bool = False):
        self.engine = async_engine
        self.fault_injection = fault_injection
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer_vocab_size or vocab_size
        self.created = int(time.time())
        self.http_requests: dict[tuple[str, int], int] = {}
        self.app = self._build_app()

    @classmethod
    def from_engine(cls, engine: Any, async_engine: AsyncEngine | None = None,
                    fault_injection: bool = False) -> "Server":
        """Wrap an ``LLMEngine`` (started in a background thread unless ``async_engine`` is given).
        ``fault_injection`` opens POST /debug/fault (campaign servers only)."""
        tok = engine.tokenizer
        vocab = _first_attr(engine, ("vocab_size", "model_config.vocab_size", "config.model_config.vocab_size",
                                     "model.config.vocab_size"))
        tok_vocab = _tokenizer_vocab_size(tok)
        if vocab is None:
            vocab = tok_vocab
        if vocab is None:
            raise RuntimeError("cannot tell the model's vocabulary size from the engine (looked for vocab_size, "
                               "model_config.vocab_size)")
        # the usable length: max_model_len, or less when the KV pool cannot hold that many tokens
        usable = int(getattr(engine, "max_seq_tokens", engine.max_model_len))
        return cls(async_engine or AsyncEngine(engine), engine.model_name, tok, usable,
                   int(vocab), min(int(tok_vocab), int(vocab)) if tok_vocab else None, fault_injection)

    # -- parsing --------------------------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                           status=404, param="model", code="model_not_found")

    def _token_ids(self, ids: list, where: str) -> list[int]:
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ApiError(f"{where}[{i}] = {t!r} is not a token id; accepted: integers in "
                               f"[0, {self.vocab_size})", param="prompt")
        return list(ids)

    def _prompts(self, body: dict) -> list[list[int]]:
        """OpenAI's four prompt shapes -> a list of token-id lists."""
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError("prompt is required: a string, a list of strings, a list of token ids, or a list of "
                           "token-id lists", param="prompt")
        p = body["prompt"]
        if isinstance(p, str):
            batch: list = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
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
                ids = list(self.tokenizer.encode(item))
            else:
                ids = self._token_ids(item, where)
            if not ids:
                raise ApiError(f"{where} has no tokens", param="prompt")
            out.append(ids)
        return out

    def _params(self, body: dict, prompt_len: int, default_max_tokens: int | None) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                           f"{prompt_len} tokens, leaving no room for a completion", param="prompt",
                           code="context_length_exceeded")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = default_max_tokens if default_max_tokens is not None else room
        elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(f"{name} must be an integer >= 1, got {max_tokens!r}", param=name)
        if prompt_len + max_tokens > self.max_model_len:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens; you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                           f"completion). Reduce the prompt or {name}.", param=name,
                           code="context_length_exceeded")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list):
            raise ApiError(f"stop_token_ids must be a list of token ids, got {stop_ids!r}", param="stop_token_ids")
        self._token_ids(stop_ids, "stop_token_ids")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError(f"seed must be an integer, got {seed!r}", param="seed")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, float, lo=0.0),
                top_p=_number(body, "top_p", 1.0, float),
                top_k=_number(body, "top_k", -1, int),
                seed=seed,
                ignore_eos=_bool(body, "ignore_eos", False),
                stop_token_ids=list(stop_ids),
            )
        except RequestError as e:
            raise _request_error(e) from None

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _bool(body, "stream", False)
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise ApiError(f"stream_options must be an object, got {opts!r}", param="stream_options")
        if not stream:
            raise ApiError("stream_options is only allowed with stream=true", param="stream_options")
        return stream, _bool(opts, "include_usage", False)

    # -- generation -----------------------------------------------------------------------------------------
    async def _start(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> list:
        """Add every prompt of the request; if one is rejected, abort the ones already added."""
        streams = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params)):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", ids, sp))
        except RequestError as e:
            for s in streams:
                self.engine.abort(s.request_id)
            raise _request_error(e) from None
        except EngineDeadError as e:
            for s in streams:
                self.engine.abort(s.request_id)
            raise ApiError(str(e), status=503, type="server_error", code="engine_dead") from None
        return streams

    async def _merged(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) from every stream as it arrives; closing this aborts the unfinished."""
        if len(streams) == 1:                  # the common case, without a task per stream
            async for out in self.engine.stream_outputs(streams[0]):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for out in self.engine.stream_outputs(s):
                    queue.put_nowait((i, out))
            except BaseException as e:     # forwarded so the consumer raises it
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()                      # stream_outputs' finally aborts the unfinished request

    # -- endpoints --------------------------------------------------------------------------------------------
    async def completions(self, body: dict, chat: bool, request: Request | None = None):
        self._check_model(body)
        _check_unsupported(body)
        stream, include_usage = self._stream_flags(body)
        if chat:
            prompts = [self._chat_prompt(body)]
            params = [self._params(body, len(prompts[0]), None)]
        else:
            prompts = self._prompts(body)
            params = [self._params(body, len(p), 16) for p in prompts]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams = await self._start(rid, prompts, params)
        if stream:
            return _SSEResponse(self._sse(rid, prompts, streams, include_usage, chat))
        if request is None:
            return await self._full(rid, prompts, streams, chat)
        # Non-streaming: nothing is sent until the end, so watch the connection; a client that hangs up gets its
        # requests aborted (the streaming path learns it from Starlette cancelling the body iterator).
        full = asyncio.ensure_future(self._full(rid, prompts, streams, chat))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((full, gone), return_when=asyncio.FIRST_COMPLETED)
        if full.done():
            gone.cancel()
            return full.result()
        full.cancel()           # -> stream_outputs' finally aborts every unfinished request
        await asyncio.gather(full, return_exceptions=True)
        return JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                       "param": None, "code": None}}, status_code=499)

    def _chat_prompt(self, body: dict) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(f"model {self.model_name!r} has no chat template; use /v1/completions",
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
        ids = list(self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]}
                                                       for m in msgs]))
        if not ids:
            raise ApiError("messages rendered to an empty prompt", param="messages")
        return ids

    async def _full(self, rid: str, prompts: list[list[int]], streams: list, chat: bool) -> JSONResponse:
        ids: list[list[int]] = [[] for _ in streams]
        reasons: list[str | None] = [None] * len(streams)
        try:
            async for i, out in self._merged(streams):
                ids[i].extend(out.new_token_ids)
                if out.finished:
                    reasons[i] = out.outputs[0].finish_reason if out.outputs else None
        except EngineDeadError as e:
            raise ApiError(str(e), status=503, type="server_error", code="engine_dead") from None
        choices = []
        for i, toks in enumerate(ids):
            text = self.tokenizer.decode(toks)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": reasons[i], "token_ids": toks})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reasons[i],
                                "token_ids": toks})
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": _usage(prompts, ids),
        })

    async def _sse(self, rid: str, prompts: list[list[int]], streams: list, include_usage: bool,
                   chat: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'{{"id":"{rid}","object":"{obj}","created":{created},"model":{json.dumps(self.model_name)},'
        detoks = [self.tokenizer.stream_decoder() for _ in prompts]     # text deltas, never half a character
        counts = [0] * len(streams)
        try:
            async for i, out in self._merged(streams):
                reason = (out.outputs[0].finish_reason if out.outputs else None) if out.finished else None
                new = out.new_token_ids
                if not new and reason is not None:          # finished with no token this step
                    new = [None]
                for k, tok in enumerate(new):
                    last = k == len(new) - 1
                    text = detoks[i].step(tok) if tok is not None else ""
                    if last and reason is not None:
                        text += detoks[i].finish()
                    toks = [tok] if tok is not None else []
                    counts[i] += len(toks)
                    fin = reason if last else None
                    if chat:
                        # OpenAI sends the role in a content-less first chunk; we fold it into the first token's
                        # chunk to keep exactly one chunk per token.
                        delta = {"role": "assistant", "content": text} if counts[i] == len(toks) else \
                            {"content": text}
                        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": fin,
                                  "token_ids": toks}
                    else:
                        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": fin,
                                  "token_ids": toks}
                    yield (f"data: {head}\"choices\":[{_dumps(choice)}]}}\n\n").encode()
            if include_usage:
                usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": sum(counts),
                         "total_tokens": sum(map(len, prompts)) + sum(counts)}
                yield f"data: {head}\"choices\":[],\"usage\":{_dumps(usage)}}}\n\n".encode()
        except EngineDeadError as e:   # headers are sent: report in-band, as OpenAI does for mid-stream errors
            err = ApiError(str(e), status=503, type="server_error", code="engine_dead")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def metrics_text(self) -> str:
        st = self.engine.stats()
        p = "vtengine"
        total = st.get("kv_blocks_total", 0)
        free = st.get("kv_blocks_free", 0)
        rows = [
            ("num_requests_running", "gauge", "Requests in the running batch.", st.get("num_running", 0)),
            ("num_requests_waiting", "gauge", "Requests waiting for admission.", st.get("num_waiting", 0)),
            ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", total),
            ("kv_blocks_free", "gauge", "KV cache blocks free.", free),
            ("kv_blocks_used", "gauge", "KV cache blocks held by sequences.", total - free),
            ("generation_tokens_total", "counter", "Tokens generated.", st.get("tokens_generated_total", 0)),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", st.get("prompt_tokens_total", 0)),
            ("requests_finished_total", "counter", "Requests that finished generating (stop or length).",
             st.get("requests_finished_total", 0)),
            ("engine_steps_total", "counter", "Engine steps.", st.get("steps_total", 0)),
            ("engine_step_time_seconds_sum", "counter", "Total time in engine steps.", st.get("step_time_s_sum", 0.0)),
            ("engine_step_time_seconds_last", "gauge", "Duration of the last engine step.",
             st.get("step_time_s_last", 0.0)),
            ("engine_decode_steps_total", "counter", "Engine steps that decoded (no prefill).",
             st.get("decode_steps_total", 0)),
            ("engine_decode_time_seconds_sum", "counter", "Total time in decode steps.",
             st.get("decode_time_s_sum", 0.0)),
            ("num_preemptions_total", "counter", "Sequences preempted (KV pool full) and recomputed later.",
             st.get("num_preemptions", 0)),
            ("peak_gpu_memory_bytes", "gauge", "Peak GPU memory allocated by the engine (0 on CPU).",
             st.get("peak_gpu_memory_bytes", 0)),
            ("engine_alive", "gauge", "1 while the engine thread runs.", int(bool(st.get("engine_alive")))),
        ]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} {kind}", f"{p}_{name} {_num(value)}"]
        lines += [f"# HELP {p}_http_requests_total HTTP requests by route and status.",
                  f"# TYPE {p}_http_requests_total counter"]
        for (route, status), n in sorted(self.http_requests.items()):
            lines.append(f'{p}_http_requests_total{{route="{route}",status="{status}"}} {n}')
        lines += counters.prometheus_lines(p)
        lines += self._info_lines(p)
        return "\n".join(lines) + "\n"

    def _info_lines(self, p: str) -> list[str]:
        """Info series (value 1, the facts in labels): what a campaign records as an arm's context."""
        eng = self.engine.engine
        lines = []
        levers = getattr(eng, "levers", None)
        if levers is not None:
            lines += [f"# HELP {p}_lever_info Every lever's resolved value and where it came from.",
                      f"# TYPE {p}_lever_info gauge"]
            for name, value in sorted(levers.values.items()):
                text = {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
                lines.append(f'{p}_lever_info{{lever="{name}",value="{text}",source="{levers.sources[name]}"}} 1')
        build = build_info(eng)
        if build:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(build.items()))
            lines += [f"# HELP {p}_build_info What this server runs.", f"# TYPE {p}_build_info gauge",
                      f"{p}_build_info{{{labels}}} 1"]
        return lines

    async def set_fault(self, body: Any) -> dict:
        from vtengine.faults import FaultError, Fault, set_fault
        try:
            fault = Fault.from_dict(body if isinstance(body, dict) else None)
        except (FaultError, TypeError, ValueError) as e:
            raise ApiError(str(e), param="kind", code="invalid_fault") from None
        await self.engine.call(lambda eng: set_fault(eng, fault))
        return {"fault": fault.to_dict() if fault else None}

    # -- app ----------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="vtengine", docs_url=None, redoc_url=None, openapi_url=None)
        srv = self

        @app.exception_handler(ApiError)
        async def api_error(_request: Request, e: ApiError):
            return e.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            msg = f"{request.method} {request.url.path}: {e.detail}"
            return ApiError(msg, status=e.status_code, type=kind).response()

        @app.exception_handler(Exception)
        async def server_error(_request: Request, e: Exception):
            return ApiError(f"internal error: {e!r}", status=500, type="server_error").response()

        async def json_body(request: Request) -> dict:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(f"request body is not valid JSON: {e}", code="invalid_json") from None
            if not isinstance(body, dict):
                raise ApiError(f"request body must be a JSON object, got {type(body).__name__}",
                               code="invalid_json")
            return body

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await srv.completions(await json_body(request), chat=False, request=request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await srv.completions(await json_body(request), chat=True, request=request)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "vtengine",
                "root": srv.model_name, "max_model_len": srv.max_model_len, "vocab_size": srv.vocab_size,
                "tokenizer_vocab_size": srv.tokenizer_vocab_size,
            }]}

        @app.get("/health")
        async def health():
            if not srv.engine.is_alive:
                return ApiError(f"engine is not running: {srv.engine.error!r}", status=503,
                                type="server_error", code="engine_dead").response()
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(srv.metrics_text(), media_type="text/plain; version=0.0.4")

        if srv.fault_injection:
            @app.post("/debug/fault")
            async def debug_fault(request: Request):
                raw = await request.body()
                try:
                    body = json.loads(raw) if raw.strip() else None
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ApiError(f"request body is not valid JSON: {e}", code="invalid_json") from None
                return await srv.set_fault(body)

        return _count_requests(app, self.http_requests)


_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def _count_requests(app, table: dict):
    """Pure ASGI wrapper counting responses by (path, status); BaseHTTPMiddleware would re-buffer every SSE
    chunk through a memory stream."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in _ROUTES else "other"     # bounded label set
                key = (path, message["status"])
                table[key] = table.get(key, 0) + 1
            await send(message)

        return await app(scope, receive, counting_send)

    wrapped.fastapi_app = app
    return wrapped


class _SSEResponse(StreamingResponse):
    """An SSE stream that always closes its generator, so a client that hangs up gets its request aborted
    (and its KV blocks freed) now rather than whenever the generator is garbage-collected."""

    def __init__(self, gen: AsyncIterator[bytes]):
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# ---------------------------------------------------------------------------------------------------------------
# helpers


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _usage(prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    p = sum(map(len, prompts))
    c = sum(map(len, outputs))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _num(v: Any) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def _short(v: Any, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def build_info(engine: Any) -> dict[str, str]:
    """What an engine runs, as label values: model, quant, dtype, device, torch and triton versions."""
    import torch
    cfg = getattr(engine, "config", None)
    dev = getattr(engine, "device", None)
    if cfg is None or dev is None:
        return {}
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"model": str(getattr(engine, "model_name", cfg.model)), "quant": str(cfg.quant),
            "dtype": str(engine.dtype).replace("torch.", ""), "device": name, "torch": torch.__version__,
            "triton": triton_version, "backend": str(getattr(engine.backend, "name", "?"))}


def _first_attr(obj: Any, dotted: tuple[str, ...]) -> Any:
    for path in dotted:
        cur = obj
        for part in path.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                break
        if isinstance(cur, int) and not isinstance(cur, bool):
            return cur
    return None


def _tokenizer_vocab_size(tok: Any) -> int | None:
    """The base vocabulary without added special tokens where the tokenizer says (transformers' ``vocab_size``
    excludes added tokens such as Qwen's chat markers, which sit above it), else the tokenizer's id range."""
    for obj in (getattr(tok, "hf", None), tok):
        v = getattr(obj, "vocab_size", None) if obj is not None else None
        if isinstance(v, int):
            return v
    return None


# ---------------------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="vtengine serve", description="OpenAI-compatible server for vtengine.")
    ap.add_argument("--model", required=True, help="a preset name (conf/model/) or a path (HF dir or .gguf)")
    ap.add_argument("--quant", default="bf16", help="bf16 | mxfp4 | nvfp4 (default bf16)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (the ready line says which)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch (engine default if unset)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--backend", default=None, help="triton | torch (default: triton on CUDA, torch on CPU)")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE",
                    help="set a lever for this server (repeatable); VT_* env variables work too")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager decode")
    ap.add_argument("--triton-kernels", default=None, metavar="K1,K2",
                    help="with the triton backend, route only these kernels through Triton (the rest: torch "
                         "references); CPU rehearsals use the lever's own kernels")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    ap.add_argument("--fault-injection", action="store_true",
                    help="open POST /debug/fault, through which a campaign gate breaks this server on purpose to "
                         "prove it can fail (never for real serving)")
    args = ap.parse_args(argv)
    levers = {}
    for item in args.lever:
        name, eq, value = item.partition("=")
        if not eq or not name or not value:
            ap.error(f"--lever {item!r}: expected NAME=VALUE, e.g. --lever gqa_swap=true")
        levers[name.strip()] = value.strip()
    args.levers = levers
    return args


def engine_config(args: argparse.Namespace):
    from vtengine.config import EngineConfig
    kw: dict[str, Any] = dict(model=args.model, quant=args.quant, backend=args.backend, levers=args.levers,
                              cuda_graphs=not args.no_cuda_graphs)
    if args.triton_kernels:
        kw["triton_kernels"] = [k.strip() for k in args.triton_kernels.split(",") if k.strip()]
    for name in ("max_num_seqs", "max_model_len", "gpu_memory_utilization", "seed"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return EngineConfig(**kw)


class UvicornServer(uvicorn.Server):
    """uvicorn on a pre-bound socket (so port 0 works and the port is known); prints the single ready line once
    it accepts connections. ``run()`` blocks; set ``should_exit = True`` from another thread to stop it."""

    def __init__(self, server: Server, sock: socket.socket, log_level: str = "warning", quiet: bool = False):
        super().__init__(uvicorn.Config(server.app, log_level=log_level, access_log=False, timeout_keep_alive=30))
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.model_name = server.model_name
        self.quiet = quiet

    def run(self, sockets=None):
        return super().run(sockets=[self.sock])

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and not self.should_exit and not self.quiet:
            print(f"vtengine serve: ready at {self.url} (model {self.model_name!r})", flush=True)


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def start_in_thread(server: Server, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                    quiet: bool = True) -> UvicornServer:
    """Serve ``server`` from a daemon thread (tests, in-process campaigns); returns once it accepts connections.
    Stop with ``stop_thread(uv)``. ``uv.url`` is the base URL."""
    import threading

    uv = UvicornServer(server, bind_socket(host, port), quiet=quiet)
    uv.thread = threading.Thread(target=uv.run, name="vtengine-http", daemon=True)
    uv.thread.start()
    deadline = time.monotonic() + timeout_s
    while not uv.started:
        if not uv.thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server at {uv.url} did not start within {timeout_s} s")
        time.sleep(0.01)
    return uv


def stop_thread(uv: UvicornServer, timeout_s: float = 10.0) -> None:
    uv.should_exit = True
    uv.thread.join(timeout_s)


def main(argv: list[str] | None = None) -> int:
    """``vtengine serve --model M [--quant Q] [--port P] [--host H] [--max-num-seqs N] [--max-model-len L]
    [--gpu-memory-utilization F] [--backend B] [--lever name=value ...] [--no-cuda-graphs] [--seed S]``"""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from vtengine.config import ConfigError
    from vtengine.levers import LeverError
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"vtengine serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        from vtengine.engine.llm_engine import LLMEngine
        engine = LLMEngine(engine_config(args))
    except (ConfigError, LeverError, RequestError, FileNotFoundError) as e:
        print(f"vtengine serve: {e}", file=sys.stderr)
        return 2
    server = Server.from_engine(engine, fault_injection=args.fault_injection)
    uv = UvicornServer(server, sock, log_level=args.log_level)
    try:
        uv.run()
    finally:
        server.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
