"""Malformed requests against a real server (tiny model, loopback): every one gets a 4xx with an OpenAI-shaped error
whose ``param`` names the bad field (None where the body has no field to name), and the server keeps serving.

Each case is (what, method, path, body, status, param); a body given as bytes is sent as is, with
``content-type: application/json`` unless the case says otherwise. The cases marked "was 500" or "was 200" are the
defects this suite was written against (vtengine/protocol.py's docstring says who checks what).
"""
from __future__ import annotations

import httpx
import pytest

from helpers import serving

pytestmark = pytest.mark.timeout(180)

DEEP = 100_000          # levels of nesting: json.loads raises RecursionError long before


def raw(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


C = "/v1/completions"
CHAT = "/v1/chat/completions"
OK = '"prompt": "hi", "max_tokens": 2'      # a valid remainder, so each case has exactly one bad field

CASES = [
    # -- the body itself
    ("malformed JSON", "POST", C, raw('{"prompt": "hi", '), 400, None),
    ("empty body", "POST", C, b"", 400, None),
    ("JSON array body", "POST", C, raw("[1, 2]"), 400, None),
    ("JSON string body", "POST", C, raw('"hi"'), 400, None),
    ("JSON null body", "POST", C, raw("null"), 400, None),
    ("form-encoded body", "POST", C, raw("prompt=hi&max_tokens=2"), 400, None),
    ("invalid UTF-8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, None),
    # was 500 (RecursionError): nesting past Python's recursion limit
    ("deeply nested array body", "POST", C, b"[" * DEEP, 400, None),
    ("deeply nested prompt", "POST", C, b'{"prompt": ' + b"[" * DEEP, 400, "prompt"),
    ("deeply nested unknown option, closed", "POST", C,
     raw('{' + OK + ', "logprobs": ') + b"[" * 5000 + b"]" * 5000 + b"}", 400, "logprobs"),
    # was 500: an integer longer than Python's int/str conversion limit (4300 digits)
    ("5000-digit max_tokens", "POST", C, raw('{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}"), 400,
     "max_tokens"),
    ("5000-digit token id", "POST", C, raw('{"prompt": [5, 1' + "0" * 5000 + "]}"), 400, "prompt"),
    # -- numbers: NaN and infinities (Python's json accepts NaN, Infinity, -Infinity), huge, wrong types
    ("temperature Infinity (was 200)", "POST", C, raw('{' + OK + ', "temperature": Infinity}'), 400, "temperature"),
    ("temperature Infinity, streamed", "POST", C, raw('{' + OK + ', "stream": true, "temperature": Infinity}'), 400,
     "temperature"),
    ("temperature -Infinity", "POST", C, raw('{' + OK + ', "temperature": -Infinity}'), 400, "temperature"),
    ("temperature NaN", "POST", C, raw('{' + OK + ', "temperature": NaN}'), 400, "temperature"),
    ("temperature 1e400 (a float overflowing to inf)", "POST", C, raw('{' + OK + ', "temperature": 1e400}'), 400,
     "temperature"),
    ("temperature 10**400 (an int past float, was 500)", "POST", C,
     raw('{' + OK + ', "temperature": 1' + "0" * 400 + "}"), 400, "temperature"),
    ("negative temperature", "POST", C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("string temperature", "POST", C, {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("boolean temperature", "POST", C, {"prompt": "hi", "temperature": True}, 400, "temperature"),
    ("top_p NaN", "POST", C, raw('{' + OK + ', "top_p": NaN}'), 400, "top_p"),
    ("top_p Infinity", "POST", C, raw('{' + OK + ', "top_p": Infinity}'), 400, "top_p"),
    ("top_p 0", "POST", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p 1.5", "POST", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k float", "POST", C, {"prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ("top_k -2", "POST", C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("top_k Infinity", "POST", C, raw('{' + OK + ', "top_k": Infinity}'), 400, "top_k"),
    ("max_tokens -1", "POST", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens 0", "POST", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens 2.5", "POST", C, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens Infinity", "POST", C, raw('{"prompt": "hi", "max_tokens": Infinity}'), 400, "max_tokens"),
    ("max_tokens 10**30", "POST", C, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    ("max_tokens as string", "POST", C, {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("max_completion_tokens 0", "POST", C, {"prompt": "hi", "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("seed string", "POST", C, {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    ("seed float", "POST", C, {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("seed 2**64", "POST", C, {"prompt": "hi", "temperature": 0.7, "seed": 2**64}, 400, "seed"),
    ("seed -2**63 - 1", "POST", C, {"prompt": "hi", "temperature": 0.7, "seed": -2**63 - 1}, 400, "seed"),
    # -- prompts
    ("missing prompt", "POST", C, {"max_tokens": 2}, 400, "prompt"),
    ("null prompt", "POST", C, {"prompt": None}, 400, "prompt"),
    ("empty prompt", "POST", C, {"prompt": ""}, 400, "prompt"),
    ("empty token list", "POST", C, {"prompt": []}, 400, "prompt"),
    ("empty list in a batch", "POST", C, {"prompt": [[5, 6], []]}, 400, "prompt"),
    ("empty string in a batch", "POST", C, {"prompt": ["a", ""]}, 400, "prompt"),
    ("prompt nested three deep", "POST", C, {"prompt": [[[5, 6]]]}, 400, "prompt"),
    ("prompt mixing ids and text", "POST", C, {"prompt": [5, "a"]}, 400, "prompt"),
    ("prompt object", "POST", C, {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("prompt number", "POST", C, {"prompt": 42}, 400, "prompt"),
    ("prompt boolean", "POST", C, {"prompt": True}, 400, "prompt"),
    ("token id == vocab size", "POST", C, {"prompt": [5, 512]}, 400, "prompt"),
    ("token id 10**30", "POST", C, {"prompt": [5, 10**30]}, 400, "prompt"),
    ("negative token id", "POST", C, {"prompt": [5, -1]}, 400, "prompt"),
    ("boolean token id", "POST", C, {"prompt": [5, True]}, 400, "prompt"),
    ("float token id", "POST", C, {"prompt": [5, 6.0]}, 400, "prompt"),
    ("NaN token id", "POST", C, raw('{"prompt": [5, NaN]}'), 400, "prompt"),
    # was 500 (UnicodeEncodeError in the tokenizer)
    ("lone surrogate in the prompt", "POST", C, raw('{"prompt": "\\ud800"}'), 400, "prompt"),
    ("prompt longer than the context", "POST", C, {"prompt": [5] * 2048}, 400, "prompt"),
    ("prompt + max_tokens past the context", "POST", C, {"prompt": [5] * 2040, "max_tokens": 16}, 400,
     "max_tokens"),
    # -- options we do not support: rejected by name, never silently ignored
    ("n = 2", "POST", C, {"prompt": "hi", "n": 2}, 400, "n"),
    ("n = true (was 200)", "POST", C, {"prompt": "hi", "n": True}, 400, "n"),
    ("n as string", "POST", C, {"prompt": "hi", "n": "1"}, 400, "n"),
    ("best_of 3", "POST", C, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("logprobs 5", "POST", C, {"prompt": "hi", "logprobs": 5}, 400, "logprobs"),
    ("top_logprobs 2", "POST", C, {"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs"),
    ("echo", "POST", C, {"prompt": "hi", "echo": True}, 400, "echo"),
    ("stop strings", "POST", C, {"prompt": "hi", "stop": ["\n"]}, 400, "stop"),
    ("suffix", "POST", C, {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("logit_bias", "POST", C, {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("presence_penalty", "POST", C, {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("frequency_penalty NaN", "POST", C, raw('{' + OK + ', "frequency_penalty": NaN}'), 400, "frequency_penalty"),
    ("repetition_penalty", "POST", C, {"prompt": "hi", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("tools", "POST", C, {"prompt": "hi", "tools": [{"type": "function"}]}, 400, "tools"),
    ("response_format json", "POST", C, {"prompt": "hi", "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    # -- flags and lists
    ("stream not a bool", "POST", C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("stream_options not an object", "POST", C, {"prompt": "hi", "stream": True, "stream_options": "x"}, 400,
     "stream_options"),
    ("stream_options without stream", "POST", C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("include_usage not a bool", "POST", C,
     {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage"),
    ("ignore_eos not a bool", "POST", C, {"prompt": "hi", "ignore_eos": "no"}, 400, "ignore_eos"),
    ("stop_token_ids not a list", "POST", C, {"prompt": "hi", "stop_token_ids": 5}, 400, "stop_token_ids"),
    ("stop_token_ids outside the vocabulary (param was 'prompt')", "POST", C,
     {"prompt": "hi", "stop_token_ids": [600]}, 400, "stop_token_ids"),
    # -- model, routes, methods
    ("model not a string", "POST", C, {"prompt": "hi", "model": 5}, 400, "model"),
    ("unknown model", "POST", C, {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("chat messages not a list", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("chat without a template", "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
    ("GET on a POST route", "GET", C, None, 405, None),
    ("unknown route", "POST", "/v1/nothing", {"prompt": "hi"}, 404, None),
]


@pytest.fixture(scope="module")
def served():
    with serving(max_num_seqs=4) as (server, url):
        yield server, url


def send(url: str, method: str, path: str, body, content_type: str = "application/json") -> httpx.Response:
    if body is None:
        return httpx.request(method, f"{url}{path}", timeout=60)
    if isinstance(body, bytes):
        return httpx.request(method, f"{url}{path}", content=body, headers={"content-type": content_type},
                             timeout=60)
    return httpx.request(method, f"{url}{path}", json=body, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None, what: str) -> dict:
    assert r.status_code == status, f"{what}: {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"{what}: {err}"
    assert isinstance(err["message"], str) and err["message"], f"{what}: {err}"
    assert err["type"] == ("not_found_error" if status == 404 and param is None else "invalid_request_error"), err
    assert err["param"] == param, f"{what}: param {err['param']!r}, expected {param!r} ({err['message']})"
    assert len(err["message"]) < 1000, f"{what}: the message echoes the whole value ({len(err['message'])} chars)"
    return err


def assert_still_serving(url: str) -> None:
    good = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2, good.text


@pytest.mark.parametrize("what,method,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_4xx_naming_the_field(served, what, method, path, body, status, param):
    _, url = served
    content_type = "application/x-www-form-urlencoded" if what == "form-encoded body" else "application/json"
    assert_error(send(url, method, path, body, content_type), status, param, what)
    assert_still_serving(url)


def test_there_are_enough_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_body_over_the_limit_gets_413(served, monkeypatch):
    server, url = served
    monkeypatch.setattr(server, "max_body_bytes", 4096)
    body = {"prompt": [5] * 3000, "max_tokens": 2}             # ~6 KB of JSON
    err = assert_error(send(url, "POST", C, body), 413, None, "declared length over the limit")
    assert "4096" in err["message"] and err["code"] == "request_too_large"

    def chunks():                   # no Content-Length (chunked): cut off as it arrives
        yield b'{"prompt": ['
        for _ in range(2000):
            yield b"5, "
        yield b"5]}"
    r = httpx.post(f"{url}{C}", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert_error(r, 413, None, "chunked body over the limit")
    assert_still_serving(url)


def test_a_default_max_tokens_takes_the_room_the_prompt_leaves(served):
    """A completion that sends no max_tokens gets OpenAI's 16, or the room its prompt leaves where that is less: a
    400 telling it to reduce a field it never sent was no answer (as vLLM clamps it)."""
    server, url = served
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 2040, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 8 and r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 4, "ignore_eos": True}, timeout=60)
    assert len(r.json()["choices"][0]["token_ids"]) == 16


def test_rejected_requests_leave_nothing_behind(served):
    """After every malformed request the engine holds no sequence and no KV block, and counted each 4xx."""
    from campaigns.loadgen import parse_prometheus
    _, url = served
    for what, method, path, body, status, param in CASES[:20]:
        send(url, method, path, body)
    m = parse_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)
    assert m["vtengine_kv_blocks_used"] == 0 and m["vtengine_num_requests_running"] == 0
    assert m["vtengine_num_requests_waiting"] == 0 and m["vtengine_engine_alive"] == 1
    assert m['vtengine_http_requests_total{route="/v1/completions",status="400"}'] >= 20
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
