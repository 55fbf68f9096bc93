"""`serve --ray` (server/ray_serve.py) on a local Ray cluster started here, with a real redis-server:
two replicas over the shared Redis tier; a module one replica encodes is a store hit in the other; an
ingest made while serving is seen by the next request; streaming passes through Ray Serve's proxy to
the openai client. And the two start-up failures, each an exit 1 within seconds."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rag_promptcache.rag.corpus import Corpus
from tests.store_helpers import free_port
from tests.test_cli_failures import cli
from tests.tiny_llama import build_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    "cats.txt": "Cats sleep sixteen hours a day. A cat purrs when it is content.",
    "bread.txt": "Sourdough bread rises with wild yeast fed with flour and water.",
}
QUESTION = "How long do cats sleep?"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return build_tiny_corpus(tmp_path_factory, DOCS)


def test_unreachable_cluster_exits_1_in_seconds(corpus: Path) -> None:
    from rag_promptcache.server.ray_serve import probe

    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"cannot reach the Ray cluster at '127.0.0.1:{port}'"):
        probe(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5  # ray.init itself retries for a minute or more
    with pytest.raises(ValueError, match="not HOST:PORT"):
        probe("somewhere")
    # the command: exit 1 with that line (its own start-up is the imports' time, not Ray's)
    out = cli("serve", "--corpus", str(corpus), "--ray", "--ray-address", f"127.0.0.1:{port}", timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"cannot reach the Ray cluster at '127.0.0.1:{port}'" in out.stderr


def test_without_ray_exits_1_with_the_install_hint(corpus: Path, tmp_path: Path) -> None:
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here', name='ray')\n")
    out = cli("serve", "--corpus", str(corpus), "--ray", env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "pip install 'rag-promptcache[ray]'" in out.stderr


def test_refresh_picks_up_an_ingest_made_by_another_handle(corpus: Path, tmp_path: Path) -> None:
    replica = Corpus.open(corpus, redis_url="")
    assert not replica.refresh()  # nothing changed since it opened
    before = len(replica.index)
    (tmp_path / "tides.txt").write_text("Tides follow the moon; spring tides come at new and full moon.")
    Corpus.build([tmp_path], corpus, progress=False, redis_url="").close()
    assert len(replica.index) == before  # not yet: a request in flight keeps what it had
    assert replica.refresh() and len(replica.index) > before
    assert any(replica.label(m).endswith("tides.txt") for m, _ in replica.search("When are spring tides?", k=3))
    assert not replica.refresh()
    replica.close()


@pytest.fixture(scope="module")
def cluster(corpus: Path, redis_server):
    pytest.importorskip("ray.serve")
    from rag_promptcache.server.ray_serve import ReplicaOptions, serve_ray

    port = free_port()
    ready, stop, failed = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            serve_ray(corpus, replicas=2, port=port, cpus_per_replica=0.5, ready=ready, stop=stop,
                      opts=ReplicaOptions(str(corpus), redis_url=redis_server.url), log=lambda _: None)
        except BaseException as e:  # reported by the fixture below
            failed.append(e)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(240) and not failed, failed
    yield f"http://127.0.0.1:{port}"
    stop.set()
    thread.join(60)


def _ask(base: str, question: str) -> tuple[str, dict]:
    body = {"model": "c", "messages": [{"role": "user", "content": question}], "max_tokens": 2}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-replica"], r.json()


@pytest.mark.ray
@pytest.mark.slow
def test_a_module_one_replica_encodes_is_a_store_hit_in_the_other(cluster: str) -> None:
    first: dict[str, dict] = {}
    for _ in range(30):  # the proxy picks the replica: ask until both answered once
        replica, body = _ask(cluster, QUESTION)
        first.setdefault(replica, body)
        if len(first) == 2:
            break
    assert len(first) == 2, f"one replica answered every request: {list(first)}"
    encoder, reader = list(first.values())
    assert encoder["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing in Redis, no disk tier
    # the other replica's first request: its memory tier was empty, so the hit came from Redis
    assert reader["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reader["choices"][0]["message"]["content"] == encoder["choices"][0]["message"]["content"]


@pytest.mark.ray
@pytest.mark.slow
def test_an_ingest_while_serving_is_seen_by_the_next_request(cluster: str, corpus: Path, redis_server,
                                                              tmp_path: Path) -> None:
    question = "Why do zebras have stripes?"
    _, before = _ask(cluster, question)
    assert all("zebra" not in s["label"] for s in before["sources"])
    (tmp_path / "zebra.txt").write_text("Zebras have stripes that confuse biting flies.")
    Corpus.build([tmp_path], corpus, progress=False, redis_url=redis_server.url).close()
    for _ in range(2):  # whichever replica answers
        _, after = _ask(cluster, question)
        assert any("zebra" in s["label"] for s in after["sources"]), after["sources"]


@pytest.mark.ray
@pytest.mark.slow
def test_streaming_passes_through_the_proxy_to_the_openai_client(cluster: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="c", messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=3, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert json.loads(chunks[0].model_dump_json())["choices"]
