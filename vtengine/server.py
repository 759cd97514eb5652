"""``vtengine serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncEngine``.

This module wires the app: the routes, the exception handlers that shape every error, the request counter, the
uvicorn server on a pre-bound socket, and the CLI. What a route does lives elsewhere (as in vLLM's entrypoints):

    vtengine/protocol.py   a request body parsed once into prompts + SamplingParams, or an error naming the field
    vtengine/serving.py    completions served: engine streams fanned in, SSE chunks or a full response
    vtengine/metrics.py    what /metrics exposes (a prometheus-client registry per server)

Endpoints
    POST /v1/completions        prompt: text, token ids, or a batch of either; max_tokens (default 16), temperature
                                (default 1.0), top_p, top_k, seed, ignore_eos, stop_token_ids, stream,
                                stream_options.include_usage
    POST /v1/chat/completions   messages (role/content strings), when the tokenizer has a chat template;
                                max_tokens or max_completion_tokens (default: what fits in max_model_len)
    GET  /v1/models             the served model, with non-standard ``max_model_len`` and ``vocab_size`` fields
    GET  /health                200 while the engine thread is alive, 503 after it died
    GET  /metrics               Prometheus text: requests running/waiting, KV blocks and KV usage, token and request
                                counters, engine step time, kernel route counters, peak GPU memory, latency
                                histograms (TTFT, ITL, E2E, queue time), and two info series: every lever's resolved
                                value and source (vtengine_lever_info) and what the server runs (vtengine_build_info:
                                model, quant, dtype, device, torch, triton)
    POST /debug/fault           only with --fault-injection (campaign servers): {"kind": ..., ...} sets a deliberate
                                fault of vtengine/faults.py (a gate's self-check), {} or null mends it

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (malformed
or too deeply nested JSON, bad field types or values, prompt too long, token ids outside the vocabulary, n > 1,
unsupported options), 404 for an unknown model or route, 405 for a wrong method, 413 for a body over
``protocol.MAX_BODY_BYTES``, 503 when the engine is dead; the server keeps serving after any of them.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import Any

from vtengine.engine.async_engine import AsyncEngine
from vtengine.engine.sampling_params import RequestError
from vtengine.protocol import MAX_BODY_BYTES, ApiError, ModelSpec, parse_completion_request, parse_json, parse_object

try:        # the server stack is optional for the offline engine; fail with a message, not an ImportError trace
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from vtengine.metrics import CONTENT_TYPE, ServerMetrics
    from vtengine.serving import CompletionServing
except ImportError as e:      # pragma: no cover
    raise ImportError(f"vtengine serve needs fastapi, uvicorn and prometheus-client ({e}); "
                      f"pip install fastapi uvicorn prometheus-client") from None


class Server:
    """The app and its state: the async engine, what the handlers need to know about the model, the metrics."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, tokenizer: Any, max_model_len: int,
                 vocab_size: int, tokenizer_vocab_size: int | None = None, fault_injection: bool = False):
        self.engine = async_engine
        self.fault_injection = fault_injection
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer_vocab_size or vocab_size
        self.max_body_bytes = MAX_BODY_BYTES
        self.created = int(time.time())
        self.model = ModelSpec(model_name, max_model_len, vocab_size, tokenizer)
        self.metrics = ServerMetrics(async_engine)
        self.serving = CompletionServing(async_engine, model_name, tokenizer, self.metrics)
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

    def metrics_text(self) -> str:
        return self.metrics.render().decode()

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
            return _error_response(e)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            msg = f"{request.method} {request.url.path}: {e.detail}"
            return _error_response(ApiError(msg, status=e.status_code, type=kind))

        @app.exception_handler(Exception)
        async def server_error(_request: Request, e: Exception):
            return _error_response(ApiError(f"internal error: {e!r}", status=500, type="server_error"))

        async def completion(request: Request, chat: bool):
            arrival = time.perf_counter()           # TTFT and queue time start here (vtengine/metrics.py)
            body = parse_object(await _read_body(request, srv.max_body_bytes))
            req = parse_completion_request(body, srv.model, chat=chat)
            return await srv.serving.create(req, request, arrival)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await completion(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await completion(request, chat=True)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "vtengine",
                "root": srv.model_name, "max_model_len": srv.max_model_len, "vocab_size": srv.vocab_size,
                "tokenizer_vocab_size": srv.tokenizer_vocab_size,
                "max_num_seqs": getattr(srv.engine.engine, "max_num_seqs", None),
            }]}

        @app.get("/health")
        async def health():
            if not srv.engine.is_alive:
                return _error_response(ApiError(f"engine is not running: {srv.engine.error!r}", status=503,
                                                type="server_error", code="engine_dead"))
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

        if srv.fault_injection:
            @app.post("/debug/fault")
            async def debug_fault(request: Request):
                return await srv.set_fault(parse_json(await _read_body(request, srv.max_body_bytes), empty_ok=True))

        return _count_requests(app, srv.metrics)


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it passes ``limit`` bytes (checked as it arrives: a client that lies in
    Content-Length, or sends none, is cut off at the limit too)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(f"request body is {size} bytes or more; the limit is {limit} bytes", status=413,
                    code="request_too_large")


_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def _count_requests(app, metrics: ServerMetrics):
    """Pure ASGI wrapper counting responses by (path, status); BaseHTTPMiddleware would re-buffer every SSE
    chunk through a memory stream."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in _ROUTES else "other"     # bounded label set
                metrics.count_http(path, message["status"])
            await send(message)

        return await app(scope, receive, counting_send)

    wrapped.fastapi_app = app
    return wrapped


# ---------------------------------------------------------------------------------------------------------------
# construction helpers


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
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="running sequences at most (unset: sized from the KV pool, at most 256)")
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
    ap.add_argument("--exit-with-parent", action="store_true",
                    help="exit when the process that started this server dies, even by SIGKILL (campaign servers: "
                         "an 8B server holds half a GPU, and must not outlive its campaign)")
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


def exit_with_parent(poll_s: float = 0.5, grace_s: float = 10.0) -> None:
    """Die with the parent: on Linux the kernel sends SIGTERM when it exits (PR_SET_PDEATHSIG), and a watch
    thread covers the rest (a parent that died before the request, other platforms): when the parent pid changes
    (reparented), SIGTERM to ourselves (uvicorn shuts down gracefully), then a hard exit after ``grace_s``."""
    import os
    import signal
    import threading

    parent = os.getppid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)
    if parent == 1:                 # already orphaned before we could ask
        os._exit(1)
    threading.Thread(target=watch, name="vtengine-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """``vtengine serve --model M [--quant Q] [--port P] [--host H] [--max-num-seqs N] [--max-model-len L]
    [--gpu-memory-utilization F] [--backend B] [--lever name=value ...] [--no-cuda-graphs] [--seed S]
    [--exit-with-parent] [--fault-injection]``"""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.exit_with_parent:
        exit_with_parent()
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
