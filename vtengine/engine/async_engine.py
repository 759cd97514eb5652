"""AsyncEngine: the synchronous ``LLMEngine`` driven by one background thread, fed and drained from asyncio.

``LLMEngine`` is not thread-safe, so exactly one thread (the engine thread) ever touches it. Everything else talks
to that thread through an inbox of commands (add, abort) and gets results back on per-request ``asyncio.Queue``s,
filled with ``loop.call_soon_threadsafe`` because an asyncio queue may only be touched from its own loop.

The engine thread loops:

    wait on a condition until the inbox is non-empty or the engine has work (no busy spin when idle)
    drain the inbox: add_request / abort_request          <- requests join and leave between steps
    step() once, publish each output to its request's queue (one thread-safe callback per loop per step)
    refresh the stats snapshot that /metrics reads

That is continuous batching as vLLM's AsyncLLMEngine does it: a request added while others decode joins the next
step's batch; a finished or aborted one leaves it. Cancelling ``generate`` (the client hung up) aborts the request
on the engine thread, which frees its KV blocks before the next step.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator

from vtengine.engine.outputs import CompletionOutput, RequestOutput
from vtengine.engine.sampling_params import RequestError, SamplingParams
from vtengine.engine.sequence import SequenceTimes


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown, or step() raised); in-flight and new requests fail with this."""


@dataclass
class _Stream:
    """The asyncio side of one request: where its outputs go. Owned by the engine thread once added."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    finished: bool = False
    # the engine's timestamps of this request (arrival, first scheduled, each token, finish): written by the engine
    # thread, complete once the stream delivered its finished output (the delivery happens after the step)
    times: SequenceTimes | None = None


# Items put on a request's queue besides RequestOutputs.
_ACCEPTED = object()           # add_request succeeded: generate() may start yielding


class AsyncEngine:
    """Wraps an ``LLMEngine`` (or anything with its add_request/abort_request/step/has_unfinished_requests/stats)."""

    def __init__(self, engine: Any, start: bool = True):
        self.engine = engine
        self._cv = threading.Condition()
        # ("add", stream, prompt, params, arrival_time) | ("abort", id) | ("call", stream, fn)
        self._inbox: collections.deque = collections.deque()
        self._streams: dict[str, _Stream] = {}                        # engine thread only
        self._stopping = False
        self._error: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self._stats_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="vtengine-engine", daemon=True)
        self._refresh_stats()
        if start:
            self.start()

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step; requests still in flight end with EngineDeadError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- asyncio side -----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield a RequestOutput per step that gave it tokens, the last one ``finished``.

        Raises RequestError (before yielding anything) if the engine rejects the request. Closing or cancelling the
        iterator early aborts the request and frees its KV blocks."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in self.stream_outputs(stream):
            yield out

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None) -> _Stream:
        """Queue the request and wait until the engine thread accepted it (RequestError if it did not).

        Split from iteration so that the server can answer a bad request with a 400 before it commits to a
        streaming 200. If the caller is cancelled while waiting, the request is aborted. ``arrival_time``
        (``time.perf_counter()``) is when the request reached the server: its queue time and TTFT start there, not
        when the engine thread gets to it between two steps."""
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue())
        self._post(("add", stream, prompt, params, arrival_time))
        try:
            first = await stream.queue.get()
        except BaseException:
            self.abort(request_id)
            raise
        if first is not _ACCEPTED:
            stream.finished = True
            raise first
        return stream

    async def stream_outputs(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            if not stream.finished:         # cancelled, closed early, or the consumer raised: free the blocks
                self.abort(stream.request_id)

    async def call(self, fn) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result (or raise its error):
        the one way to change the engine while it serves (e.g. a gate's deliberate fault, vtengine/faults.py)."""
        stream = _Stream(f"call-{id(fn)}", asyncio.get_running_loop(), asyncio.Queue())
        self._post(("call", stream, fn))
        result = await stream.queue.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; aborting a finished or unknown request is a no-op."""
        self._post(("abort", request_id))

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of the last step or command, plus the loop's own state. Safe from any thread."""
        with self._stats_lock:
            return dict(self._stats)

    def _post(self, cmd: tuple) -> None:
        with self._cv:
            if self._stopping or self._error is not None:
                if cmd[0] in ("add", "call"):
                    err = EngineDeadError(f"engine is not running: {self._error or 'shut down'}")
                    cmd[1].loop.call_soon_threadsafe(cmd[1].queue.put_nowait, err)
                return
            self._inbox.append(cmd)
            self._cv.notify()

    # -- engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        # this pass's replies (a command's result, an add's acceptance or rejection, the step's outputs), sent
        # after the step; if the step raises, they go out before the engine's death (a reply held here was lost
        # with its caller waiting forever)
        deliveries: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._stopping and not eng.has_unfinished_requests():
                        self._cv.wait()
                    if self._stopping:
                        break
                    cmds = list(self._inbox)
                    self._inbox.clear()
                for cmd in cmds:
                    self._handle(cmd, deliveries)
                if eng.has_unfinished_requests():
                    fault = getattr(eng, "fault", None)
                    drop = fault is not None and fault.kind == "drop_token"
                    for out in eng.step():
                        stream = self._streams.get(out.request_id)
                        if stream is None:      # aborted between the step's scheduling and now: drop
                            continue
                        if out.finished:
                            del self._streams[out.request_id]
                        out = _detach(out)
                        if drop and len(out.outputs[0].token_ids) == 2:
                            out.new_token_ids = []      # a deliberate fault (drop_token): a token lost in transit
                        deliveries[stream.loop].append((stream.queue, out))
                # stats first: a client that got its last token and reads /metrics must see this step counted
                self._refresh_stats()
                sent, deliveries = deliveries, collections.defaultdict(list)
                self._deliver(sent)
        except BaseException as e:        # an engine bug: fail every request loudly instead of hanging them
            self._error = e
            traceback.print_exc()
        finally:
            with self._cv:
                self._stopping = True
                pending = [c[1] for c in self._inbox if c[0] in ("add", "call")]
                self._inbox.clear()
            err = EngineDeadError(f"engine stopped: {self._error!r}" if self._error else "engine shut down")
            for stream in list(self._streams.values()) + pending:
                deliveries[stream.loop].append((stream.queue, err))
            self._streams.clear()
            self._deliver(deliveries)
            self._refresh_stats()

    def _handle(self, cmd: tuple, deliveries: dict) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, stream, prompt, params, arrival_time = cmd
            if stream.request_id in self._streams:
                result: Any = RequestError(f"request id {stream.request_id!r} is already in flight")
            else:
                try:
                    # arrival_time only when given, so an engine without timing hooks still serves
                    kw = {} if arrival_time is None else {"arrival_time": arrival_time}
                    seq = eng.add_request(stream.request_id, prompt, params, **kw)
                    stream.times = getattr(seq, "times", None)
                    self._streams[stream.request_id] = stream
                    result = _ACCEPTED
                except RequestError as e:
                    result = e
                except Exception as e:      # a bad request must fail alone, never the engine thread
                    eng.abort_request(stream.request_id)
                    result = RequestError(f"request rejected: {e}")
            deliveries[stream.loop].append((stream.queue, result))
        elif cmd[0] == "call":
            _, stream, fn = cmd
            try:
                result = fn(eng)
            except Exception as e:          # reported to the caller; the engine thread goes on
                result = e
            deliveries[stream.loop].append((stream.queue, result))
        elif cmd[0] == "abort":
            stream = self._streams.pop(cmd[1], None)
            if stream is None:              # already finished (its blocks are freed) or never accepted
                return
            eng.abort_request(stream.request_id)
            out = RequestOutput(stream.request_id, [], [CompletionOutput(0, [], finish_reason="abort")],
                                finished=True)
            deliveries[stream.loop].append((stream.queue, out))

    @staticmethod
    def _deliver(deliveries: dict) -> None:
        # One callback per event loop per step: cheaper than one per request, and ordered per queue.
        for loop, items in deliveries.items():
            if items:
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:        # that loop is closed: its requests' consumers are gone
                    pass

    def _refresh_stats(self) -> None:
        try:
            st = dict(self.engine.stats())
        except Exception as e:  # stats must never take the loop down
            st = {"stats_error": repr(e)}
        st["engine_alive"] = self._error is None and not self._stopping
        st["stats_time_s"] = time.time()
        with self._stats_lock:
            self._stats = st


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _detach(out: RequestOutput) -> RequestOutput:
    """A copy the asyncio side may read while the engine thread keeps stepping.

    This step's fields (new_token_ids, finished, finish_reason) are copied. ``outputs[i].token_ids`` is shared, not
    copied (copying every sequence's whole output every step is O(n^2)): it is complete once ``finished``; before
    that, read ``new_token_ids``."""
    return RequestOutput(
        request_id=out.request_id,
        prompt_token_ids=out.prompt_token_ids,          # never mutated after add_request
        outputs=[CompletionOutput(o.index, o.token_ids, o.text, o.finish_reason) for o in out.outputs],
        finished=out.finished,
        new_token_ids=list(out.new_token_ids),
        prompt=out.prompt,
    )
