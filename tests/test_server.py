"""vtengine serve on CPU: a real uvicorn server on loopback over the real engine with the ``tiny`` model.

The async-vs-sync anchor (concurrent streamed greedy requests == offline ``LLM.generate`` token for token), the
SSE format and usage counts, client disconnect freeing the sequence, and 4xx for bad requests with the server
still serving afterwards.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from vtengine.config import EngineConfig
from vtengine.engine.llm import LLM
from vtengine.engine.llm_engine import LLMEngine
from vtengine.engine.sampling_params import SamplingParams
from vtengine.server import Server, parse_args, engine_config, start_in_thread, stop_thread
from helpers import serving

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def served():
    with serving(max_num_seqs=8) as (server, url):
        yield server, url
    assert not server.engine._thread.is_alive(), "engine thread did not stop on shutdown"


@pytest.fixture(scope="module")
def offline():
    return LLM(model="tiny", max_num_seqs=8)


def sse_events(resp: httpx.Response) -> list:
    """The data payloads of an SSE response, parsed (``[DONE]`` kept as the string)."""
    events = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data line: {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(url: str) -> dict[str, float]:
    from campaigns.loadgen import parse_prometheus
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_prometheus(r.text)


def test_stream_format_and_usage(served):
    server, url = served
    prompt = "The quick brown fox"
    n_prompt = len(server.tokenizer.encode(prompt))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks, usage = ev[:-2], ev[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": n_prompt + 7}
    assert len(chunks) == 7, "one chunk per generated token"
    ids = []
    for k, c in enumerate(chunks):
        assert c["object"] == "text_completion" and c["model"] == "tiny" and c["id"] == chunks[0]["id"]
        (choice,) = c["choices"]
        assert choice["index"] == 0 and len(choice["token_ids"]) == 1
        assert choice["finish_reason"] == ("length" if k == 6 else None)
        ids += choice["token_ids"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == server.tokenizer.decode(ids)

    # the same request without streaming: same tokens (greedy), same text, usage always present
    body.pop("stream_options")
    r2 = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60)
    assert r2.status_code == 200
    full = r2.json()
    assert full["object"] == "text_completion"
    assert full["choices"][0]["token_ids"] == ids and full["choices"][0]["text"] == text
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": n_prompt + 7}

    # streaming without include_usage: no usage chunk
    r3 = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    ev3 = sse_events(r3)
    assert ev3[-1] == "[DONE]" and all(e["choices"] for e in ev3[:-1]) and len(ev3) == 8


def test_stop_token_ids_and_batch_prompt(served):
    server, url = served
    base = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0},
                      timeout=60).json()["choices"][0]["token_ids"]
    # stop at the first occurrence of the 4th token: the engine must finish there with reason "stop"
    stop_tok = base[3]
    first = base.index(stop_tok)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0,
                                                  "stop_token_ids": [stop_tok]}, timeout=60).json()
    assert r["choices"][0]["token_ids"] == base[:first + 1]
    assert r["choices"][0]["finish_reason"] == "stop"
    # a batch of two token-id prompts, streamed: choices indexed 0 and 1, usage summed
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": [[5, 6, 7, 8], [9, 10, 11]], "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    ev = sse_events(r)
    by_index = {0: [], 1: []}
    for c in ev[:-2]:
        by_index[c["choices"][0]["index"]] += c["choices"][0]["token_ids"]
    assert by_index[0] == base and len(by_index[1]) == 8
    assert ev[-2]["usage"] == {"prompt_tokens": 7, "completion_tokens": 16, "total_tokens": 23}


def test_concurrent_streams_equal_offline_generate(served, offline):
    """The async_parity anchor: 8 concurrent streamed greedy requests (joining the batch at different steps)
    produce exactly the tokens of in-process synchronous generation."""
    _, url = served
    prompts = ["Once upon a time", "The capital of Portugal is", [5, 9, 200, 31, 7], "a", "Hello, world!",
               [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310], "0 1 2 3 4 5 6 7 8 9", "¿Qué tal? ✓"]
    max_tokens = 12
    want = [o.outputs[0].token_ids for o in
            offline.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
    assert all(len(w) == max_tokens for w in want)

    async def one(client, prompt, delay):
        await asyncio.sleep(delay)         # staggered: requests join a batch that is already decoding
        ids = []
        async with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return ids

    async def all_of_them():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p, 0.05 * (i % 4)) for i, p in enumerate(prompts)))

    got = asyncio.run(all_of_them())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i} ({prompts[i]!r}): served {g} != offline {w}"


def test_disconnect_frees_sequence(served):
    server, url = served
    m0 = metrics(url)
    assert m0["vtengine_kv_blocks_used"] == 0 and m0["vtengine_num_requests_running"] == 0
    max_tokens = 1500
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": "x" * 200, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            lines = resp.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
            mid = metrics(url)
            # the sequence is live and holds blocks for its 201-token prompt
            assert mid["vtengine_num_requests_running"] == 1
            assert mid["vtengine_kv_blocks_used"] >= 201 // 16
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while True:
        m = metrics(url)
        if m["vtengine_kv_blocks_used"] == 0 and m["vtengine_num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks not freed after disconnect: {m}"
        time.sleep(0.05)
    assert m["vtengine_kv_blocks_free"] == m0["vtengine_kv_blocks_free"]
    generated = m["vtengine_generation_tokens_total"] - m0["vtengine_generation_tokens_total"]
    assert 3 <= generated < max_tokens, "the aborted request kept generating"
    assert m["vtengine_requests_finished_total"] == m0["vtengine_requests_finished_total"]
    time.sleep(0.3)          # the engine stays idle: no tokens appear after the abort
    assert metrics(url)["vtengine_generation_tokens_total"] == m["vtengine_generation_tokens_total"]


BAD_REQUESTS = [
    # (what, path, body (dict or raw bytes), status, param)
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("JSON not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("string max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("prompt too long", "/v1/completions", {"prompt": [5] * 2040, "max_tokens": 16}, 400, "max_tokens"),
    ("prompt alone too long", "/v1/completions", {"prompt": [5] * 2048}, 400, "prompt"),
    ("token id past the vocabulary", "/v1/completions", {"prompt": [5, 512]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [[5, 6], [-1]]}, 400, "prompt"),
    ("float token id", "/v1/completions", {"prompt": [5, 6.5]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("n > 1", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    # an out-of-range seed once killed the engine thread (torch's manual_seed overflowed): it must fail alone
    ("seed out of range", "/v1/completions", {"prompt": "hi", "temperature": 0.7, "seed": 2**64}, 400, "seed"),
    ("top_p out of range", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("bad top_k", "/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("stop strings", "/v1/completions", {"prompt": "hi", "stop": ["\n"]}, 400, "stop"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("stream not a bool", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("chat without a template", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400,
     "messages"),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_then_good_one(served, what, path, body, status, param):
    _, url = served
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{url}{path}", timeout=30, **kw)
    assert r.status_code == status, f"{what}: {r.status_code} {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, f"{what}: {err}"
    good = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0},
                      timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_models_health_metrics_and_unknown_route(served):
    server, url = served
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    (m,) = models["data"]
    assert m["id"] == "tiny" and m["max_model_len"] == server.max_model_len and m["vocab_size"] == 512
    assert m["max_num_seqs"] == server.engine.engine.max_num_seqs >= 1      # what the engine sized or was given
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    r = httpx.get(f"{url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for name in ("vtengine_num_requests_running", "vtengine_num_requests_waiting", "vtengine_kv_blocks_free",
                 "vtengine_kv_blocks_used", "vtengine_generation_tokens_total", "vtengine_engine_step_time_seconds_sum",
                 "vtengine_peak_gpu_memory_bytes", "vtengine_kernel_launches_total"):
        assert f"\n{name}" in text or text.startswith(name) or f"# TYPE {name}" in text, name
    m = metrics(url)
    assert m["vtengine_engine_steps_total"] > 0 and m["vtengine_engine_step_time_seconds_sum"] > 0
    assert m["vtengine_kv_blocks_total"] == server.engine.engine.block_manager.num_blocks


def test_cli_args_become_engine_config():
    args = parse_args(["--model", "tiny", "--max-num-seqs", "4", "--lever", "gqa_swap=true",
                       "--lever", "nsplits_cap=auto", "--no-cuda-graphs", "--port", "0"])
    cfg = engine_config(args)
    assert cfg.model == "tiny" and cfg.max_num_seqs == 4 and cfg.cuda_graphs is False
    assert cfg.levers == {"gqa_swap": "true", "nsplits_cap": "auto"}
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny", "--lever", "gqa_swap"])


def _byte_bpe_with_chat_template():
    """A real transformers tokenizer (byte-level BPE, no merges, ChatML template) that fits the tiny model's
    512-token vocabulary: the tiny preset's own byte tokenizer has no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vtengine.tokenizer import HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                               additional_special_tokens=["<|im_start|>"], chat_template=template))


def test_chat_completions_with_template():
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=4))
    engine.tokenizer = _byte_bpe_with_chat_template()
    server = Server.from_engine(engine)
    uv = start_in_thread(server)
    try:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]
        prompt_ids = engine.tokenizer.apply_chat_template(msgs)
        body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        full = httpx.post(f"{uv.url}/v1/chat/completions", json=body, timeout=60).json()
        assert full["object"] == "chat.completion"
        (choice,) = full["choices"]
        assert choice["message"]["role"] == "assistant" and len(choice["token_ids"]) == 6
        assert choice["message"]["content"] == engine.tokenizer.decode(choice["token_ids"])
        assert full["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 6,
                                 "total_tokens": len(prompt_ids) + 6}
        # the same conversation as a token-id completion gives the same tokens
        comp = httpx.post(f"{uv.url}/v1/completions", json={"prompt": prompt_ids, "max_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True}, timeout=60).json()
        assert comp["choices"][0]["token_ids"] == choice["token_ids"]
        r = httpx.post(f"{uv.url}/v1/chat/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}, timeout=60)
        ev = sse_events(r)
        chunks = ev[:-2]
        assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 6 and len(chunks) == 6
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        assert [c["choices"][0]["token_ids"][0] for c in chunks] == choice["token_ids"]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == choice["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        bad = httpx.post(f"{uv.url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                         timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        # a conversation that fills the context names the field it came from (chat has no prompt field)
        long = [{"role": "user", "content": "x" * 4000}]
        bad = httpx.post(f"{uv.url}/v1/chat/completions", json={"messages": long}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.json()
        assert bad.json()["error"]["code"] == "context_length_exceeded"
    finally:
        stop_thread(uv)
        server.engine.shutdown()


def test_serve_cli_prints_ready_line_and_serves():
    """`python -m vtengine.server` as a process: one ready line with the URL, then it answers."""
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "vtengine.server", "--model", "tiny", "--port", "0",
                             "--max-num-seqs", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 90
        while "ready at" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, f"server did not get ready: {line!r}"
            line = proc.stdout.readline()
        url = re.search(r"ready at (http://\S+)", line).group(1)
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_cli_user_errors_exit_2(capsys):
    from vtengine.server import main
    assert main(["--model", "no-such-model", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "Traceback" not in err
    assert main(["--model", "tiny", "--port", "0", "--lever", "gqa_swap=maybe"]) == 2
    assert "gqa_swap" in capsys.readouterr().err


def test_disconnect_during_non_streaming_request_frees_sequence(served):
    _, url = served
    m0 = metrics(url)
    with pytest.raises(httpx.ReadTimeout):      # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json={"prompt": "y" * 100, "max_tokens": 1500, "temperature": 0,
                                                  "ignore_eos": True}, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.monotonic() + 20
    while True:
        m = metrics(url)
        if m["vtengine_kv_blocks_used"] == 0 and m["vtengine_num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks not freed after disconnect: {m}"
        time.sleep(0.05)
    generated = m["vtengine_generation_tokens_total"] - m0["vtengine_generation_tokens_total"]
    assert 1 <= generated < 1500
    assert m["vtengine_requests_finished_total"] == m0["vtengine_requests_finished_total"]


@pytest.mark.parametrize("async_scheduling,before_fault", [(False, 3), (True, 2)], ids=["sync", "async"])
def test_engine_failure_fails_requests_loudly(async_scheduling, before_fault):
    """A deliberate fault in the model runner: the in-flight request and every later one get a 503 (or an
    in-band error chunk once streaming), /health says 503; nothing hangs. (With a step in flight, the third step's
    token is still on the device when the fourth step breaks: two tokens reach the client.)"""
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=2, levers={"async_scheduling": async_scheduling}))
    real_logits, calls = engine.runner._logits, []

    def broken_after_three_steps(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected fault in the model runner")
        return real_logits(*args, **kwargs)

    engine.runner._logits = broken_after_three_steps
    server = Server.from_engine(engine)
    uv = start_in_thread(server)
    try:
        r = httpx.post(f"{uv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 10, "stream": True},
                       timeout=30)
        ev = sse_events(r)
        assert r.status_code == 200 and ev[-1] == "[DONE]"
        assert [len(e["choices"][0]["token_ids"]) for e in ev[:before_fault]] == [1] * before_fault
        assert "injected fault" in ev[before_fault]["error"]["message"] and len(ev) == before_fault + 2
        r = httpx.post(f"{uv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        h = httpx.get(f"{uv.url}/health", timeout=10)
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
        r = httpx.post(f"{uv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True},
                       timeout=30)
        assert r.status_code == 503
        assert metrics(uv.url)["vtengine_engine_alive"] == 0
    finally:
        stop_thread(uv)
        server.engine.shutdown()


def test_the_replies_of_the_pass_whose_step_dies_still_reach_their_callers():
    """A command's result and an add's rejection are sent after the pass's step: when that step raised, they were
    dropped with the pass, and their callers (a /debug/fault call, a rejected request) waited forever. They now go
    out before the engine's death, and the decoding request gets the death in band."""
    from vtengine.engine.async_engine import AsyncEngine, EngineDeadError
    from vtengine.engine.sampling_params import RequestError
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=2))
    ae = AsyncEngine(engine)

    def breaks_the_next_step(eng):
        def step():
            raise RuntimeError("injected fault in the step")
        eng.step = step
        return "broken"

    async def main():
        params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        stream = await ae.add_request("r1", [5, 6, 7], params)
        # posted together: the engine thread takes both in one pass, then its step dies
        called, added = await asyncio.wait_for(asyncio.gather(
            ae.call(breaks_the_next_step), ae.add_request("r1", [5, 6], params), return_exceptions=True), 20)
        assert called == "broken"
        assert isinstance(added, (RequestError, EngineDeadError)), added     # a duplicate id, or a dead engine
        with pytest.raises(EngineDeadError, match="injected fault in the step"):
            async for _ in ae.stream_outputs(stream):
                pass
    try:
        asyncio.run(main())
    finally:
        ae.shutdown()


def test_a_batch_of_prompts_is_admitted_in_one_step(served):
    """The prompts of one request are posted together, so the engine prefills them in one step: awaited one by one,
    each add waited for the engine's next step and 8 prompts took 8 prefill steps (7 of them beside decoding)."""
    server, url = served
    m0 = metrics(url)
    body = {"model": "tiny", "prompt": [[5, 6, 7, 8]] * 8, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    m = metrics(url)
    steps = m["vtengine_engine_steps_total"] - m0["vtengine_engine_steps_total"]
    decode = m["vtengine_engine_decode_steps_total"] - m0["vtengine_engine_decode_steps_total"]
    assert steps - decode <= 2, (steps, decode)          # one prefill step (two where the thread split the posts)
    assert m["vtengine_generation_tokens_total"] - m0["vtengine_generation_tokens_total"] == 32


def test_a_caller_cancelled_between_two_adds_leaves_no_request_running():
    """A request's prompts are added together; where the engine accepted one before the caller was cancelled (a
    client gone while the second add waits), that one is aborted too: gather dropped its stream, and it generated
    to max_tokens holding its KV blocks. The second add is held back here to open that window every time."""
    from vtengine.engine.async_engine import AsyncEngine
    from vtengine.metrics import ServerMetrics
    from vtengine.protocol import CompletionRequest
    from vtengine.serving import CompletionServing
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=4))
    ae = AsyncEngine(engine)
    release, real_add = None, ae.add_request

    async def add_request(request_id, *args, **kwargs):
        if request_id.endswith("-1"):
            await release.wait()                 # never set: the caller is cancelled first
        return await real_add(request_id, *args, **kwargs)
    ae.add_request = add_request
    serving = CompletionServing(ae, "tiny", engine.tokenizer, ServerMetrics(ae))
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    req = CompletionRequest(chat=False, prompts=[[5, 6, 7], [8, 9]], params=[params, params], stream=True,
                            include_usage=False)

    async def main():
        nonlocal release
        release = asyncio.Event()
        task = asyncio.ensure_future(serving._start("cmpl-x", req, None))
        for _ in range(200):                     # until the first prompt is in the engine
            await asyncio.sleep(0.01)
            if ae.stats().get("running", 0) or engine.has_unfinished_requests():
                break
        assert engine.has_unfinished_requests()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)                 # an abort's time; 2000 tokens take the tiny model seconds
        assert not engine.has_unfinished_requests(), "an accepted prompt kept running after its caller left"
    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
