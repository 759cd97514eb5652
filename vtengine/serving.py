"""Serving a parsed completion request: start its prompts on the engine, fan their streams in, and answer as SSE
chunks or as one full response. Latency histograms are observed here, once per request that finished generating.

Streaming follows OpenAI's SSE format (``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``) with ONE chunk per generated
token, so a client's chunk gaps are inter-token latencies (``vllm bench serve`` counts them that way). The chunk
that carries a sequence's last token also carries its ``finish_reason``. With ``stream_options.include_usage`` a
last chunk with ``choices: []`` and exact ``usage`` precedes ``[DONE]``; non-streaming responses always carry usage.
Every choice has the non-standard ``token_ids`` (in a chunk: the one new token).

A client that hangs up gets its requests aborted (their KV blocks freed before the next step): the streaming path
learns it from Starlette closing the body iterator, the non-streaming path by watching the connection.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vtengine.engine.async_engine import AsyncEngine, EngineDeadError
from vtengine.engine.sampling_params import RequestError
from vtengine.metrics import ServerMetrics
from vtengine.protocol import ApiError, CompletionRequest

_FINISHED_GENERATING = ("stop", "length")       # not "abort": see vtengine/metrics.py


def engine_dead(e: EngineDeadError) -> ApiError:
    return ApiError(str(e), status=503, type="server_error", code="engine_dead")


class CompletionServing:
    """/v1/completions and /v1/chat/completions once the request is parsed (vLLM's ``serving_completion.py``)."""

    def __init__(self, engine: AsyncEngine, model_name: str, tokenizer: Any, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.metrics = metrics

    async def create(self, req: CompletionRequest, request: Request | None = None,
                     arrival_time: float | None = None):
        """The response to one request: a streaming SSE response, or the full JSON once every choice finished.
        ``arrival_time`` (``time.perf_counter()``) is when the HTTP request arrived."""
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams = await self._start(rid, req, arrival_time)
        if req.stream:
            return SSEResponse(self._sse(rid, req, streams))
        if request is None:
            return await self._full(rid, req, streams)
        # Non-streaming: nothing is sent until the end, so watch the connection; a client that hangs up gets its
        # requests aborted (the streaming path learns it from Starlette cancelling the body iterator).
        full = asyncio.ensure_future(self._full(rid, req, streams))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((full, gone), return_when=asyncio.FIRST_COMPLETED)
        if full.done():
            gone.cancel()
            return full.result()
        full.cancel()           # -> stream_outputs' finally aborts every unfinished request
        await asyncio.gather(full, return_exceptions=True)
        return JSONResponse({"error": {"message": "client disconnected", "type": "client_closed_request",
                                       "param": None, "code": None}}, status_code=499)

    async def _start(self, rid: str, req: CompletionRequest, arrival_time: float | None) -> list:
        """Add every prompt of the request, all posted before any is awaited (so the engine admits a batch in one
        step: awaited one by one, each add waited for the engine's next step, and a batch of N prompts was
        prefilled over N steps); if one is rejected, abort the ones added. A cancelled caller aborts them all, the
        accepted ones too."""
        rids = [f"{rid}-{i}" for i in range(len(req.prompts))]
        adds = [self.engine.add_request(r, ids, sp, arrival_time) for r, ids, sp in zip(rids, req.prompts, req.params)]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:
            # cancelled: an add still waiting aborts its own, but one the engine accepted already returned its
            # stream to gather, which drops it; abort every one (idempotent, a no-op for an unknown id)
            for r in rids:
                self.engine.abort(r)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return results
        for r in results:
            if not isinstance(r, BaseException):
                self.engine.abort(r.request_id)
        dead = [e for e in errors if isinstance(e, EngineDeadError)]
        if dead:
            raise engine_dead(dead[0]) from None
        e = errors[0]
        if isinstance(e, RequestError):
            # the protocol checked every field, so the engine rejecting one is a field we do not know of
            raise ApiError(str(e), param=e.param) from None
        raise e

    async def _merged(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) from every stream as it arrives; closing this aborts the unfinished.
        A request that finished generating has its latencies observed before its last output is yielded, so a
        client that got its last token and reads /metrics sees them."""
        async for i, out in self._fan_in(streams):
            if out.finished and out.outputs and out.outputs[0].finish_reason in _FINISHED_GENERATING:
                self.metrics.observe_finished(streams[i].times)
            yield i, out

    async def _fan_in(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
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

    async def _full(self, rid: str, req: CompletionRequest, streams: list) -> JSONResponse:
        ids: list[list[int]] = [[] for _ in streams]
        reasons: list[str | None] = [None] * len(streams)
        try:
            async for i, out in self._merged(streams):
                ids[i].extend(out.new_token_ids)
                if out.finished:
                    reasons[i] = out.outputs[0].finish_reason if out.outputs else None
        except EngineDeadError as e:
            raise engine_dead(e) from None
        choices = []
        for i, toks in enumerate(ids):
            text = self.tokenizer.decode(toks)
            if req.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": reasons[i], "token_ids": toks})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reasons[i],
                                "token_ids": toks})
        return JSONResponse({
            "id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": _usage(req.prompts, ids),
        })

    async def _sse(self, rid: str, req: CompletionRequest, streams: list) -> AsyncIterator[bytes]:
        created = int(time.time())
        chat = req.chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'{{"id":"{rid}","object":"{obj}","created":{created},"model":{json.dumps(self.model_name)},'
        detoks = [self.tokenizer.stream_decoder() for _ in req.prompts]     # text deltas, never half a character
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
            if req.include_usage:
                usage = {"prompt_tokens": sum(map(len, req.prompts)), "completion_tokens": sum(counts),
                         "total_tokens": sum(map(len, req.prompts)) + sum(counts)}
                yield f"data: {head}\"choices\":[],\"usage\":{_dumps(usage)}}}\n\n".encode()
        except EngineDeadError as e:   # headers are sent: report in-band, as OpenAI does for mid-stream errors
            yield f"data: {json.dumps(engine_dead(e).body())}\n\n".encode()
        yield b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An SSE stream that always closes its generator, so a client that hangs up gets its request aborted
    (and its KV blocks freed) now rather than whenever the generator is garbage-collected."""

    def __init__(self, gen: AsyncIterator[bytes]):
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


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
