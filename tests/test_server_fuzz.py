"""The server against schemathesis, the field's API fuzzer, over the server's own OpenAPI schema: a real
`serve --api-key` process (uvicorn on a free loopback port) over a tiny random-weight Llama's corpus,
and schemathesis' CLI sending a few hundred generated requests to every route (chat and text
completions streamed and not, embeddings, models, metrics, health, the page), valid and invalid ones,
with the key and without it.

A run fails on any 5xx, any response (a stream's events included) that its schema does not describe,
invalid data not refused with a 4xx, a route that ignores the key, a stream that carries an error or
does not end with [DONE], a request that does not answer within `REQUEST_TIMEOUT_S`, or a server that
stops answering (bench/fuzz_hooks.py; `bench --scenarios fuzz` is the longer run on the default model).
Regressions of what it found are held by name below."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rag_promptcache.bench.soak import fuzz_command
from tests.test_server import DOCS, ROOT, start_server
from tests.tiny_llama import build_tiny_corpus

pytestmark = pytest.mark.slow
KEY = "sk-fuzz-7c1d"
EXAMPLES = 12  # generated cases per route and generation mode, besides the coverage phase's
WINDOW = 384  # the tiny model's context window: every max_tokens the schema allows decodes in a second


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    corpus = build_tiny_corpus(tmp_path_factory, DOCS, max_positions=WINDOW)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc, url = start_server(corpus, log, "--api-key", KEY, "--log-format", "json", "--k", "2", "--max-batch", "4", "--max-queue", "16")
    yield proc, url, log
    proc.terminate()
    proc.wait(30)


def _fuzz(url: str, out: Path, key: str | None) -> dict:
    done = subprocess.run(fuzz_command(url, out, key=key, examples=EXAMPLES, seed=51), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                          timeout=600)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_no_generated_request_breaks_the_server(served, tmp_path):
    proc, url, log = served
    report = _fuzz(url, tmp_path / "with-key.json", KEY)
    without = _fuzz(url, tmp_path / "without-key.json", None)  # every /v1 route answers 401, as documented
    assert proc.poll() is None and httpx.get(f"{url}/health").status_code == 200
    # statuses seen, from the server's own access log: the fuzzer reached the answers, not only the refusals
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    statuses = [r["status"] for r in lines if r.get("logger") == "rag_promptcache.server.access"]
    assert 200 in statuses and 400 in statuses and 401 in statuses and not [s for s in statuses if s >= 500], statuses
    assert len(statuses) >= 200, len(statuses)
    assert report and without


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
