"""What a `serve` process says about its requests, and what its errors name, against a real process:
one JSON access line per request (200, 400, 401) with the request id the response carries and its
token counts, never the API key or the prompt; a body cut off mid-JSON and a context-window overflow
name the API's own fields; a request's `min_score` that nothing reaches is answered without generating."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.test_server import MODEL, QUESTIONS, build_corpus, start_server

pytestmark = [pytest.mark.smollm, pytest.mark.slow]
KEY = "sk-logs-3a9e"
SECRET_QUESTION = "What colour is the zorblat, asked in secret?"


@pytest.fixture(scope="module")
def served(smollm, tmp_path_factory):
    path = build_corpus(smollm, tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("srv") / MODEL)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc, url = start_server(path, log, "-k", "2", "--api-key", KEY, "--log-format", "json")
    yield url, log
    proc.kill()
    proc.wait(30)


def _post(url: str, body: bytes | dict, key: str | None = KEY) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(f"{url}/v1/chat/completions", content=raw, headers=headers, timeout=120)


def _access(log, ids: list[str]) -> dict[str, dict]:
    """The access lines by request id, once those of `ids` are written: the server writes a line after
    the response's last byte, so a client can read its response before the line is there."""
    deadline = time.monotonic() + 30
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        found = {r["request_id"]: r for r in lines if r.get("logger") == "rag_promptcache.server.access"}
        if set(ids) <= found.keys() or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_one_access_line_per_request_without_the_key_or_the_prompt(served):
    url, log = served
    ok = _post(url, {"model": MODEL, "messages": [{"role": "user", "content": SECRET_QUESTION}], "max_tokens": 6})
    bad = _post(url, {"model": MODEL, "messages": [], "max_tokens": 6})
    unauthorized = _post(url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, key=None)
    assert (ok.status_code, bad.status_code, unauthorized.status_code) == (200, 400, 401)
    lines = _access(log, [r.headers["x-request-id"] for r in (ok, bad, unauthorized)])
    for response in (ok, bad, unauthorized):
        line = lines[response.headers["x-request-id"]]
        assert (line["method"], line["route"], line["status"]) == ("POST", "/v1/chat/completions", response.status_code)
        assert line["total_s"] >= 0 and line["level"] == "info"
    line = lines[ok.headers["x-request-id"]]
    usage = ok.json()["usage"]
    assert (line["prompt_tokens"], line["cached_tokens"], line["generated_tokens"]) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])
    assert line["ttft_s"] >= 0 and lines[bad.headers["x-request-id"]]["prompt_tokens"] is None
    text = log.read_text()
    assert KEY not in text and "zorblat" not in text


def test_errors_name_the_api_fields(served):
    url, _ = served
    cut = _post(url, b'{"model": "corpus", "mess')
    err = cut.json()["error"]
    assert cut.status_code == 400 and err["param"] is None and "not valid JSON at byte" in err["message"]
    long = _post(url, {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 100_000})
    err = long.json()["error"]
    assert long.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "max_tokens" and "lower max_tokens" in err["message"] and "max_new_tokens" not in err["message"]
    newer = _post(url, {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}],
                        "max_completion_tokens": 100_000})
    assert newer.json()["error"]["param"] == "max_completion_tokens"
    huge = _post(url, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 4})
    assert huge.json()["error"]["param"] == "messages"


def test_min_score_nothing_reaches_is_answered_without_generating(served):
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=8, extra_body={"min_score": 0.99})
    assert r.choices[0].message.content == "Not found in the documents." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 0 and r.model_extra["sources"] == [] and r.usage.model_extra["path"] == "none"
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], stream=True, extra_body={"min_score": 0.99})
        if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "Not found in the documents."
    found = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=8, extra_body={"min_score": 0.1})
    assert found.usage.completion_tokens > 0 and found.model_extra["sources"]
