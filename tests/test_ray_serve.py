"""`serve --ray` (server/ray_serve.py) on a local Ray cluster started here, with a real redis-server:
two replicas (an autoscaling range of 2 to 3, read back from Ray Serve) over the shared Redis tier; a
module one replica encodes is a store hit in the other; an ingest made while serving is seen by the next
request; streaming passes through Ray Serve's proxy to the openai client; a replica killed mid-stream
ends its stream with an error event, is replaced, and the store keeps everything. Every replica serves
both corpora given (`c`, and `d` over another tiny model), each answering from its own documents. And
the start-up failures, each an exit 1 within seconds."""

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
OTHER = {"tides.md": "Spring tides come at new and full moon.", "kites.txt": "Box kites fly in steady wind."}


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
def second(tmp_path_factory) -> Path:
    return build_tiny_corpus(tmp_path_factory, OTHER, corpus="d")


@pytest.fixture(scope="module")
def cluster(corpus: Path, second: Path, redis_server):
    pytest.importorskip("ray.serve")
    from rag_promptcache.server.ray_serve import ReplicaOptions, serve_ray

    port = free_port()
    ready, stop, failed = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            serve_ray([corpus, second], autoscale=(2, 3), port=port, cpus_per_replica=0.5, ready=ready, stop=stop,
                      opts=ReplicaOptions((str(corpus), str(second)), redis_url=redis_server.url), log=lambda _: None)
        except BaseException as e:  # reported by the fixture below
            failed.append(e)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(240) and not failed, failed
    yield f"http://127.0.0.1:{port}"
    stop.set()
    thread.join(60)


def _ask(base: str, question: str, model: str = "c") -> tuple[str, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 2}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-replica"], r.json()


@pytest.mark.ray
@pytest.mark.slow
def _stored(base: str, replica: str) -> None:
    """Wait until `replica`'s background encoder has written what its questions deferred (the proxy picks
    the replica each /health goes to: ask until that one says its queue is empty)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.get(f"{base}/health", timeout=30)
        if r.headers.get("x-replica") == replica and r.json()["background_queue"] == 0:
            return
        time.sleep(0.1)
    pytest.fail(f"replica {replica} did not store its deferred modules in 120 s")


def test_a_module_one_replica_encodes_is_a_store_hit_in_the_other(cluster: str) -> None:
    encoder, first = _ask(cluster, QUESTION)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing in Redis, no disk tier
    assert first["usage"]["served"] == "deferred"  # computed in the request, written to Redis after it
    _stored(cluster, encoder)
    answers: dict[str, dict] = {}
    for _ in range(30):  # the proxy picks the replica: ask until both answered once more
        replica, body = _ask(cluster, QUESTION)
        answers.setdefault(replica, body)
        if len(answers) == 2:
            break
    assert len(answers) == 2, f"one replica answered every request: {list(answers)}"
    reader = next(body for replica, body in answers.items() if replica != encoder)
    # the other replica's first request: its memory tier was empty, so the hit came from Redis
    # (a tiny model may compute one module sooner than it loads it from Redis: `served` can say "deferred")
    assert reader["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reader["choices"][0]["message"]["content"] == answers[encoder]["choices"][0]["message"]["content"]


@pytest.mark.ray
@pytest.mark.slow
def test_every_replica_serves_both_corpora_each_from_its_own_documents(cluster: str) -> None:
    cards = httpx.get(f"{cluster}/v1/models", timeout=60).json()["data"]
    assert [m["id"] for m in cards] == ["c", "d"]
    answered: dict[str, set[str]] = {}
    for _ in range(30):  # the proxy picks the replica: ask until both answered the second corpus
        replica, body = _ask(cluster, "When do spring tides come?", model="d")
        assert body["model"] == "d" and {s["label"] for s in body["sources"]} <= set(OTHER), body["sources"]
        answered.setdefault(replica, set()).update(s["label"] for s in body["sources"])
        if len(answered) == 2:
            break
    assert len(answered) == 2 and all("tides.md" in labels for labels in answered.values()), answered
    _, body = _ask(cluster, "When do spring tides come?", model="c")  # c may hold a tides.txt of its own (above)
    assert body["sources"] and not {s["label"] for s in body["sources"]} & set(OTHER)
    filtered = {"model": "d", "messages": [{"role": "user", "content": "When do spring tides come?"}], "max_tokens": 2,
                "filter": {"source": "kites.txt"}}  # every replica searches within the filter
    for _ in range(4):
        r = httpx.post(f"{cluster}/v1/chat/completions", json=filtered, timeout=120)
        assert r.status_code == 200 and {s["label"] for s in r.json()["sources"]} == {"kites.txt"}, r.text


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


def test_autoscale_and_replicas_options_are_checked() -> None:
    from rag_promptcache.server.ray_serve import ReplicaOptions, deployment_options, parse_autoscale

    assert parse_autoscale("1:4") == (1, 4) and parse_autoscale("2:2") == (2, 2)
    for bad, why in [("3:1", "MIN must be at most MAX"), ("0:2", "MIN must be at least 1"),
                     ("x", "is not MIN:MAX"), ("2:", "is not MIN:MAX"), ("-1:2", "is not MIN:MAX")]:
        with pytest.raises(ValueError, match=why):
            parse_autoscale(bad)
    opts = ReplicaOptions("c", max_batch=6)
    fixed = deployment_options(opts, 3, None, 1.0)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed and fixed["max_ongoing_requests"] == 12
    ranged = deployment_options(opts, 2, (1, 4), 0.5)
    assert "num_replicas" not in ranged
    assert ranged["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 6}
    with pytest.raises(ValueError, match="--replicas must be at least 1"):
        deployment_options(opts, 0, None, 1.0)


def test_serves_controller_gets_our_proxy_settings_unless_the_environment_has_its_own() -> None:
    """A proxy slower than Ray's 5 s readiness check three times over (a node whose cores are busy) was killed and
    `serve_ray` failed with ActorDiedError; the controller now allows PROXY_READY_ENV's timeout."""
    from rag_promptcache.server.ray_serve import PROXY_CALLBACK_ENV, PROXY_READY_ENV, controller_env

    ours = controller_env({})
    assert ours[PROXY_CALLBACK_ENV] == "rag_promptcache.server.ray_serve.proxy_middlewares"
    assert ours["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == PROXY_READY_ENV["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]
    assert float(ours["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) > 5  # Ray's default
    theirs = controller_env({PROXY_CALLBACK_ENV: "mine.callback", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "7"})
    assert theirs == {}  # what the user set is not overridden


def test_the_cli_refuses_replicas_with_autoscale_and_a_bad_range(corpus: Path) -> None:
    both = cli("serve", "--corpus", corpus, "--ray", "--replicas", "2", "--autoscale", "1:3", timeout=60)
    assert both.returncode == 1 and "--replicas and --autoscale exclude each other" in both.stderr, both.stderr
    bad = cli("serve", "--corpus", corpus, "--ray", "--autoscale", "3:1", timeout=60)
    assert bad.returncode == 1 and "--autoscale 3:1: MIN must be at most MAX" in bad.stderr, bad.stderr
    alone = cli("serve", "--corpus", corpus, "--autoscale", "1:3", timeout=60)  # without --ray: not silently ignored
    assert alone.returncode == 1 and "need --ray" in alone.stderr, alone.stderr
    assert "Traceback" not in both.stderr + bad.stderr + alone.stderr


def test_a_cut_response_ends_with_an_openai_error() -> None:
    """The proxy's middleware over a stand-in for the proxy that stops as Ray Serve's does when the
    replica dies: after a stream's first event, before any response, and after a whole response."""
    import asyncio

    from rag_promptcache.server.ray_serve import CUT_MESSAGE, EndCutResponses

    def run(messages: list[dict]) -> list[dict]:
        async def app(scope, receive, send) -> None:
            for m in messages:
                await send(m)

        sent: list[dict] = []

        async def send(m: dict) -> None:
            sent.append(m)

        asyncio.run(EndCutResponses(app)({"type": "http"}, None, send))
        return sent

    sse = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}
    first = {"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True}
    cut = run([sse, first])
    assert cut[:2] == [sse, first] and len(cut) == 3 and not cut[2].get("more_body", False)
    events = cut[2]["body"].decode().split("\n\n")
    assert json.loads(events[0].removeprefix("data: "))["error"]["message"] == CUT_MESSAGE and events[1] == "data: [DONE]"
    nothing = run([])
    assert nothing[0]["status"] == 500 and json.loads(nothing[1]["body"])["error"]["code"] == "replica_stopped"
    whole = [sse, {"type": "http.response.body", "body": b"data: [DONE]\n\n"}]
    assert run(whole) == whole


@pytest.mark.ray
@pytest.mark.slow
def test_the_deployment_runs_ray_serves_autoscaler_with_the_range(cluster: str) -> None:
    import ray

    controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    details = ray.get(controller.get_serve_instance_details.remote(), timeout=60)
    deployment = details["applications"]["rag-promptcache"]["deployments"]["PromptCacheReplica"]
    config = deployment["deployment_config"]
    assert config["autoscaling_config"]["min_replicas"] == 2 and config["autoscaling_config"]["max_replicas"] == 3
    assert config["autoscaling_config"]["target_ongoing_requests"] == 8  # max_batch: one full batch per replica
    assert config["max_ongoing_requests"] == 16
    assert len([r for r in deployment["replicas"] if r["state"] == "RUNNING"]) >= 2


def _replicas() -> set[str]:
    import ray

    return {a["name"].rpartition("#")[2] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::rag-promptcache#")}


@pytest.mark.ray
@pytest.mark.slow
def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_and_is_replaced(cluster: str, redis_server) -> None:
    """Last in the file: it kills a replica of the module's deployment."""
    import ray
    import redis
    from ray import serve

    openai = pytest.importorskip("openai")
    _ask(cluster, QUESTION)  # its modules are in Redis (either replica encoded them)
    store = redis.Redis.from_url(redis_server.url)
    before = set(store.keys("*"))
    assert before
    running = _replicas()
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0)
    pieces = []
    with pytest.raises(openai.APIError) as raised:
        with client.chat.completions.with_streaming_response.create(
                model="c", messages=[{"role": "user", "content": QUESTION}], max_tokens=1500, stream=True,
                extra_body={"ignore_eos": True}) as response:
            victim = response.headers["x-replica"]
            for chunk in response.parse():
                pieces.append(chunk)
                if len(pieces) == 3:
                    ray.kill(ray.get_actor(f"SERVE_REPLICA::rag-promptcache#PromptCacheReplica#{victim}",
                                           namespace="serve"), no_restart=True)
    assert "stopped before finishing" in str(raised.value)
    assert 3 <= len(pieces) < 1500 and pieces[-1].choices[0].finish_reason is None  # cut, not finished
    for _ in range(4):  # at once: the proxy sends nothing more to the dead replica
        assert _ask(cluster, QUESTION)[0] != victim
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # Ray Serve starts a replacement (its health check finds the dead one)
        status = serve.status().applications["rag-promptcache"].deployments["PromptCacheReplica"]
        if victim not in _replicas() and len(_replicas() - running) >= 1 and status.replica_states.get("RUNNING") == 2:
            break
        time.sleep(1)
    new = _replicas() - running
    assert new and victim not in _replicas(), (running, _replicas())
    assert before <= set(store.keys("*"))  # the store lost nothing
    for _ in range(30):  # the replacement's first answer: its memory tier is empty, so a hit is Redis's
        replica, body = _ask(cluster, QUESTION)
        if replica in new:
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            break
    else:
        pytest.fail(f"the replacement {new} answered none of 30 requests")
