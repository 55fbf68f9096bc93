"""The server against schemathesis, the field's API fuzzer, over the server's own OpenAPI schema: a real
`serve --api-key` process (uvicorn on a free loopback port) over a tiny random-weight Llama's corpus,
and schemathesis' CLI sending a few hundred generated requests to every route (chat and text
completions streamed and not, embeddings, models, metrics, health, the page), valid and invalid ones,
with the key and without it.

A run fails on any 5xx, any response (a stream's events included) that its schema does not describe,
invalid data not refused with a 4xx, a route that ignores the key, a stream that carries an error or
does not end with [DONE], a request that does not answer within `REQUEST_TIMEOUT_S`, or a server that
stops answering (benchmarks/fuzz_hooks.py; `python -m benchmarks.soak --fuzz` is the longer run on the default model).
Regressions of what it found are held by name below, and the soak's load and report run for seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks import soak
from benchmarks.soak import fuzz_command, fuzz_env
from tests.test_server import DOCS, ROOT, start_server
from tests.tiny_llama import build_tiny_corpus

pytestmark = pytest.mark.slow
KEY = "sk-fuzz-7c1d"
EXAMPLES = 8  # generated cases per route and generation mode, besides the coverage phase's
REQUEST_TIMEOUT_S = 90  # a request unanswered this long is a hung one (2,048 inputs to embed on a loaded 2-core CI took > 30 s)
SOAK_S = 8.0  # the soak's 20 minutes, shortened
WINDOW = 256  # the tiny model's context window: every max_tokens the schema allows decodes in a moment


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    corpus = build_tiny_corpus(tmp_path_factory, DOCS, max_positions=WINDOW)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc, url = start_server(corpus, log, "--api-key", KEY, "--log-format", "json", "--k", "2", "--max-batch", "4", "--max-queue", "16")
    yield proc, url, log
    proc.terminate()
    proc.wait(30)


def _fuzz(url: str, out: Path, key: str | None, examples: int, schema: Path | None = None,
          phases: str = "examples,coverage,fuzzing") -> subprocess.Popen:
    env = {**fuzz_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(fuzz_command(url, out, key=key, examples=examples, seed=51, request_timeout=REQUEST_TIMEOUT_S,
                                         schema=schema, phases=phases),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _report(run: subprocess.Popen, out: Path) -> dict:
    stdout, _ = run.communicate(timeout=600)
    assert run.returncode == 0, stdout[-12000:]
    print(*(line for line in stdout.splitlines() if " (in " in line or "generated" in line), sep="\n")
    return json.loads(out.read_text())


def test_no_generated_request_breaks_the_server(served, tmp_path):
    proc, url, log = served
    schema = tmp_path / "openapi.json"  # served only with the key
    schema.write_bytes(httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).content)
    with_key, without = tmp_path / "with-key.json", tmp_path / "without-key.json"
    # at once: the server takes both; without the key every /v1 route answers 401, as documented
    runs = [_fuzz(url, with_key, KEY, EXAMPLES), _fuzz(url, without, None, EXAMPLES, schema, "examples,fuzzing")]
    report, _ = _report(runs[0], with_key), _report(runs[1], without)
    assert proc.poll() is None and httpx.get(f"{url}/health").status_code == 200
    assert report["test_cases"]["with_failures"] == 0 and not report["errors"], report
    # statuses seen, from the server's own access log: the fuzzer reached the answers, not only the refusals
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    statuses = [r["status"] for r in lines if r.get("logger") == "rag_promptcache.server.access"]
    assert {200, 400, 401, 404, 405} <= set(statuses) and not [s for s in statuses if s >= 500], sorted(set(statuses))
    assert len(statuses) >= 1000, len(statuses)


@pytest.mark.parametrize(("extra", "status", "param"), [
    ({"temperature": 5e-324}, 200, None),  # was nan probabilities in the sampler
    ({"temperature": 5e-324, "stream": True}, 200, None),
    ({"seed": 2**64, "temperature": 1.0}, 400, "seed"),  # was an overflow in torch's generator
    ({"messages": [{"role": "user", "content": "zorblat \ud800"}]}, 400, "messages.0.content"),  # not Unicode
    ({"stop": ["\udfff"]}, 400, "stop.0"),
    ({"no_repeat_ngram": 1}, 400, "no_repeat_ngram"),
    ({"recovery": "question:0.5@99"}, 400, "recovery"),
    ({"recovery": "last:1@k>=99"}, 200, None),  # recovers only in prompts of 99 modules or more
    ({"recovery": "none@k>=2"}, 400, "recovery"),
])
def test_what_fuzzing_found_is_answered_or_refused_by_name(served, extra, status, param):
    _, url, _ = served
    body = {"model": "c", "messages": [{"role": "user", "content": "What colour is the zorblat?"}], "max_tokens": 4,
            **extra}
    r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body).encode(), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"] == param, r.text
    elif extra.get("stream"):
        data = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        assert data[-1] == "[DONE]" and not any('"error"' in d for d in data), data


def test_the_server_applies_its_repetition_control_unless_a_request_turns_it_off(served):
    """docs/limits.md and docs/server.md: on by default, off by the request's own fields."""
    _, url, _ = served
    body = {"model": "c", "prompt": "The", "max_tokens": 48, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}

    def answer(**extra: object) -> dict:
        r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    plain, off = answer(), answer(no_repeat_ngram=0, stop_repeats=False)
    assert off["usage"]["completion_tokens"] == 48
    # greedy decoding of random weights loops: a run of tokens comes back, which the default n-gram ban forbids
    assert plain["choices"][0]["text"] != off["choices"][0]["text"]


def test_a_short_soak_reports_what_the_long_one_does(served):
    """`python -m benchmarks.soak`'s load and report (benchmarks/soak.py), for seconds instead of 20 minutes: every
    kind of request is sent, none fails with a 5xx or hangs, and the server's memory and descriptors are read."""
    proc, url, _ = served
    out = soak.soak(url, proc, SOAK_S, 3, model="c", key=KEY, log=lambda _: None)
    assert out["requests"] > 0 and out["checks"]["no_5xx"] and out["checks"]["no_hung_or_refused"], out["statuses"]
    assert out["checks"]["server_alive"] and "200" in out["statuses"] and proc.poll() is None
    assert {k for w in out["latency_by_window"] for k in w} - {"window_min"} <= {k for k, _ in soak.MIX}
    readings = out["server_by_minute"]
    assert len(readings) >= 10 and all(r["rss_mib"] > 0 and r["fds"] > 0 for r in readings), readings
    assert readings[-1]["caches_mib"] > 0 and readings[-1]["rss_less_caches_mib"] < readings[-1]["rss_mib"]
