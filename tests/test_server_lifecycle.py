"""The server's API key, its start on a port in use, its /metrics, and its shutdown on SIGTERM, each against a real
`serve` process (the key set through RAG_PROMPTCACHE_API_KEY here; the page test passes --api-key).

The SIGTERM test runs last: it ends the module's server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.test_server import MODEL, QUESTIONS, ROOT, build_corpus, start_server

pytestmark = pytest.mark.smollm
KEY = "sk-test-5f2c"
SHUTDOWN_TIMEOUT = 10


@pytest.fixture(scope="module")
def served(smollm, tmp_path_factory):
    path = build_corpus(smollm, tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("srv") / MODEL)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc, url = start_server(path, log, "--k", "2", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                             env={"RAG_PROMPTCACHE_API_KEY": KEY})
    yield proc, url, log, path
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_every_route_but_health_and_the_page_needs_the_key(served):
    import openai

    _, url, _, _ = served
    assert httpx.get(f"{url}/health").status_code == 200
    page = httpx.get(f"{url}/")  # the page asks for the key itself
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "Authorization" in page.text
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4}
    for method, path, payload in [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", body),
                                  ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
                                  ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}), ("GET", "/nope", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
            r = httpx.request(method, f"{url}{path}", json=payload, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert _error(r)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert "missing API key" in _error(httpx.get(f"{url}/v1/models"))["message"]
    assert httpx.get(f"{url}/nope", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       temperature=0, max_tokens=12)
    assert "purple" in r.choices[0].message.content.lower()
    assert len(client.embeddings.create(model=MODEL, input="hi").data[0].embedding) == 384


def test_a_port_in_use_fails_in_one_line_before_announcing(served):
    _, url, _, path = served
    port = url.rsplit(":", 1)[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "rag_promptcache.cli", "serve", "--corpus", str(path), "--port", port],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done
    assert done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: the port is in use; stop the other " \
                                  "server or pick another --port", done.stderr
    assert "serving" not in done.stdout


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics with the key, parsed by prometheus-client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_need_the_key_and_count_requests_tokens_caches_and_repeats(served):
    import openai

    _, url, _, _ = served
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    before = _scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[3]}], temperature=0, max_tokens=8)
    first = client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)  # the same request: an exact repeat, no prefill
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                       if c.choices)
    assert streamed == first.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**ask, "messages": []})
    after = _scrape(url)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    p = "rag_promptcache:"
    assert grew(f"{p}requests_total", endpoint="/v1/chat/completions", status="200") == 3
    assert grew(f"{p}requests_total", endpoint="/v1/chat/completions", status="400") == 1
    c = {"corpus": MODEL}  # each corpus's series carry its name
    assert grew(f"{p}time_to_first_token_seconds_count", **c) == 3 and grew(f"{p}e2e_request_latency_seconds_count", **c) == 3
    assert grew(f"{p}inter_token_latency_seconds_count", **c) > 0
    assert grew(f"{p}prompt_tokens_total", **c) == 3 * first.usage.prompt_tokens
    assert grew(f"{p}generation_tokens_total", **c) == 3 * first.usage.completion_tokens
    assert grew(f"{p}prompt_tokens_cached_total", **c) + grew(f"{p}prompt_tokens_computed_total", **c) == 3 * first.usage.prompt_tokens
    assert grew(f"{p}prefix_cache_repeats_total") == 2 and grew(f"{p}prefix_cache_hits_total") >= 2
    assert grew(f"{p}prefix_cache_queries_total") >= 3
    assert grew(f"{p}store_hits_total", tier="all", **c) + grew(f"{p}store_misses_total", tier="all", **c) > 0
    assert {(MODEL, "memory"), (MODEL, "disk")} <= {tuple(v for _, v in labels) for name, labels in after
                                                    if name == f"{p}store_hits_total"}
    assert after[(f"{p}num_requests_running", ())] == 0 and after[(f"{p}num_requests_waiting", ())] == 0
    # this corpus was built over an in-memory store (build_corpus), so the server encodes a module when a
    # question first retrieves it, in its background encoder once no request runs: the gauge counts those
    # (k = 2) as they are written, up to the corpus's modules
    one = (("corpus", MODEL),)
    deadline = time.monotonic() + 120
    while after.get((f"{p}corpus_modules_encoded", one), 0.0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        after = _scrape(url)
    assert 2 <= after[(f"{p}corpus_modules_encoded", one)] <= after[(f"{p}corpus_modules", one)]
    assert 0 < after[(f"{p}corpus_tokens_encoded", one)] <= after[(f"{p}corpus_tokens", one)]


def test_sigterm_finishes_open_requests_then_cancels_the_rest_and_exits_0(served):
    proc, url, log, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    short = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], "stream": True,
             "temperature": 0, "max_tokens": 8}
    endless = {**short, "max_tokens": 1000, "ignore_eos": True}  # far longer than the shutdown timeout
    events: dict[str, list[str]] = {"short": [], "endless": []}
    started = {name: threading.Event() for name in events}

    def read(name: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events[name].append(line[5:].strip())
                        started[name].set()
        except httpx.HTTPError:
            pass  # the endless stream is cut when it is cancelled
        finally:
            started[name].set()

    threads = [threading.Thread(target=read, args=("endless", endless)), threading.Thread(target=read, args=("short", short))]
    threads[0].start()
    assert started["endless"].wait(120)
    threads[1].start()
    assert started["short"].wait(120)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(SHUTDOWN_TIMEOUT + 60) == 0
    for t in threads:
        t.join(30)
    assert time.monotonic() - sent >= SHUTDOWN_TIMEOUT - 1  # the endless stream held it open until the timeout
    # the short request, open when the signal came, finished whole
    assert events["short"][-1] == "[DONE]"
    finish = [c["choices"][0]["finish_reason"] for c in map(json.loads, events["short"][:-1]) if c["choices"]]
    assert finish[-1] in ("stop", "length")
    assert "[DONE]" not in events["endless"]  # cut, not finished
    said = log.read_text()
    assert re.search(r"received SIGTERM: refusing new connections; \d+ running and \d+ waiting request\(s\) get 10 s", said), said
    assert f"cancelled the requests still open after {SHUTDOWN_TIMEOUT} s" in said and "server stopped" in said
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
