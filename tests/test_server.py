"""The OpenAI-compatible server as users run it: `python -m rag_promptcache.cli serve` in a subprocess
on a free loopback port, over a small corpus built with the real SmolLM2 and embedder, driven by
real clients: the official `openai` client, LangChain's `ChatOpenAI`, LlamaIndex's `OpenAILike`,
and raw HTTP for malformed requests and disconnects. One server for the whole module.

The server runs with --max-batch 2 --max-queue 2, so four clients at once exercise rows joining a
running batch, and a fifth is refused with 429."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.store_helpers import free_port

pytestmark = [pytest.mark.smollm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    "zorblat.txt": "The zorblat is a purple fruit that grows only on the island of Quenti. "
    "It tastes like lemon and honey.\n\nFarmers harvest zorblats in the month of Ember.",
    "trains.md": "# Trains\n\nThe Blue Line train leaves the central station every 12 minutes. "
    "It stops at Harbor, Museum and Airport.",
    "castle.txt": "Castle Varn was built in 1342 by the glassmakers' guild. Its tower is 61 metres tall "
    "and its bell rings at dawn.",
}
QUESTIONS = ["What colour is the zorblat?", "How often does the Blue Line train leave?",
             "When was Castle Varn built?", "Where does the Blue Line stop?"]
MODEL = "corpus"  # the corpus directory's name is the model id
GREEDY = {"temperature": 0, "max_tokens": 12}


def build_corpus(smollm, root: Path, path: Path, docs: dict[str, str] = DOCS) -> Path:
    """The small corpus every server test answers from (`docs`, DOCS unless given), built with an in-memory
    store (no KV on disk yet: the server encodes each module when a question first retrieves it)."""
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import Corpus, Embedder
    from rag_promptcache.store import MemoryStore

    model, tokenizer = smollm
    for name, text in docs.items():
        (root / name).write_text(text)
    engine = PromptCache(model, tokenizer, store=MemoryStore(), name="smollm2-135m-instruct")
    Corpus.build([root], path, engine=engine, embedder=Embedder(), chunk_tokens=64, overlap=8, progress=False).close()
    return path


def start_server(path: Path, log_file: Path, *args: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`serve` in a subprocess, as users run it; returns once /health answers."""
    port = port or free_port()
    log = open(log_file, "w+")
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "rag_promptcache.cli", "serve", "--corpus", str(path),
                             "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log_file.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up in 300 s"
        time.sleep(0.5)
    log.close()  # the child keeps its own descriptor
    return proc, url


@pytest.fixture(scope="module")
def corpus_path(smollm, tmp_path_factory) -> Path:
    return build_corpus(smollm, tmp_path_factory.mktemp("docs"), tmp_path_factory.mktemp("srv") / MODEL)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("log") / "server.log"


@pytest.fixture(scope="module")
def base_url(corpus_path, server_log):
    proc, url = start_server(corpus_path, server_log, "--k", "2", "--max-batch", "2", "--max-queue", "2")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _idle(base_url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{base_url}/health").json()
        idle = health["running"] == 0 and health["waiting"] == 0 and health["background_queue"] == 0
        if idle or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def test_first_questions_at_once_never_wait_for_the_background_encoder(client, base_url):
    # the store is empty: each question computes its modules in its own prefill and queues them; the
    # background encoder works only between requests, so none of the four waits for an encoding
    answers: list = [None] * len(QUESTIONS)

    def ask(i: int) -> None:
        answers[i] = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTIONS[i]}], **GREEDY)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is not None and a.choices[0].message.content.strip() for a in answers), answers
    assert {a.usage.model_extra["served"] for a in answers} <= {"deferred", "store"}
    assert any(a.usage.model_extra["served"] == "deferred" for a in answers)
    assert "purple" in answers[0].choices[0].message.content.lower()
    assert _idle(base_url, timeout=120)["background_queue"] == 0
    metrics = httpx.get(f"{base_url}/metrics").text
    assert "rag_promptcache:background_failed_total 0.0" in metrics
    assert "rag_promptcache:background_encoded_total 0.0" not in metrics


def test_models_and_health(client, base_url, corpus_path):
    assert [m.id for m in client.models.list().data] == [MODEL]
    model = client.models.list().data[0]
    # the schema name /v1/completions prompts import modules from (PML), as manifest.json records it
    assert model.model_extra["schema"] == json.loads((corpus_path / "manifest.json").read_text())["name"]
    assert model.model_extra["embedder"] == "all-MiniLM-L6-v2"
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 2


def test_openai_chat_usage_sources_and_streaming(client):
    # The corpus was built with an in-memory store: the server's first request encodes and stores the
    # modules it retrieves; from the second on they are served from its store (cached_tokens).
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], **GREEDY)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "purple" in r.choices[0].message.content.lower()
    u = r.usage
    assert u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens > 20  # the retrieved modules came from the store
    sources = r.model_extra["sources"]
    assert len(sources) == 2 and sources[0]["label"].endswith("zorblat.txt") and sources[0]["score"] > 0
    assert "purple fruit" in sources[0]["snippet"]  # the chunk's text, for a person to check the answer against
    assert u.model_extra["ttft_s"] >= 0

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].model_extra["sources"] == sources
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == u.prompt_tokens_details.cached_tokens

    # history, stop strings, module_ids (no retrieval), and the raw completions endpoint
    history = [{"role": "system", "content": "Answer in one sentence."},
               {"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": "Every 12 minutes."},
               {"role": "user", "content": [{"type": "text", "text": QUESTIONS[3]}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, stop=["Museum"], **GREEDY,
                                        extra_body={"module_ids": [sources[0]["module_id"]], "recovery": "none"})
    assert "Museum" not in r2.choices[0].message.content
    assert [s["module_id"] for s in r2.model_extra["sources"]] == [sources[0]["module_id"]]
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert c.object == "text_completion" and c.choices[0].text and c.usage.completion_tokens <= 4


def test_a_follow_up_turn_reuses_the_previous_turn_from_the_prefix_cache(client):
    """The engine's prefix cache: turn 2 repeats turn 1's prompt (same modules, same order) and answer,
    so usage counts turn 1's prompt as cached (tests/test_prefix_cache.py holds the answers equal to
    the cache off)."""
    first = [{"role": "user", "content": QUESTIONS[1]}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, **GREEDY)
    ids = [s["module_id"] for s in r1.model_extra["sources"]]
    r1 = client.chat.completions.create(model=MODEL, messages=first, **GREEDY, extra_body={"module_ids": ids})
    follow = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": QUESTIONS[2]}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, **GREEDY, extra_body={"module_ids": ids})
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1, (r1.usage, r2.usage)


def test_frameworks_change_only_base_url(base_url):
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    lc = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=12)
    assert "purple" in lc.invoke(QUESTIONS[0]).content.lower()
    assert "".join(c.content for c in lc.stream(QUESTIONS[0])).lower().count("purple") >= 1
    li = OpenAILike(model=MODEL, api_base=f"{base_url}/v1", api_key="unused", is_chat_model=True,
                    temperature=0, max_tokens=12, context_window=8192)
    assert "purple" in li.chat([ChatMessage(role="user", content=QUESTIONS[0])]).message.content.lower()


def test_concurrent_clients_get_their_one_at_a_time_answers(client, base_url):
    def ask(q: str) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], **GREEDY)
        return r.choices[0].message.content

    # a module the store lacks is computed in its request (usage.served "deferred") and stored by the
    # background encoder while no request runs; from then on it is served from the store
    first = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], **GREEDY)
             for q in QUESTIONS]
    assert {r.usage.model_extra["served"] for r in first} <= {"deferred", "store"}
    assert _idle(base_url, timeout=120)["background_queue"] == 0
    metrics = httpx.get(f"{base_url}/metrics").text
    assert "rag_promptcache:background_failed_total 0.0" in metrics and "background_encoded_total" in metrics
    assert "rag_promptcache:background_not_admitted_total 0.0" in metrics  # the store has room: every miss is queued
    alone = [ask(q) for q in QUESTIONS]
    together: list[str | None] = [None] * len(QUESTIONS)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(QUESTIONS[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_disconnect_mid_stream_frees_the_row_and_a_full_queue_is_429(client, base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[2]}], "stream": True,
            "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        streams = []
        for _ in range(4):  # 2 rows + 2 in the queue
            cm = http.stream("POST", "/v1/chat/completions", json=body)
            resp = cm.__enter__()
            assert resp.status_code == 200
            streams.append((cm, resp.iter_lines()))
        deadline = time.monotonic() + 60
        while httpx.get(f"{base_url}/health").json()["running"] < 2:  # both prefilled and decoding
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{base_url}/health").json()["waiting"] == 2
        over = http.post("/v1/chat/completions", json=body)
        assert over.status_code == 429 and over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "queue_full"
        for cm, _ in streams:
            cm.__exit__(None, None, None)  # hang up mid-stream
    assert _idle(base_url)["running"] == 0  # rows freed long before 2000 tokens
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up hangs up too
        httpx.post(f"{base_url}/v1/chat/completions", json={**body, "stream": False}, timeout=httpx.Timeout(60, read=3))
    assert _idle(base_url)["running"] == 0
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], **GREEDY)
    assert r.choices[0].message.content


BAD = [
    ("malformed JSON", b'{"model": "corpus", "messages": [', 400, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("wrong type", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("last not user", {"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]}, 400, None),
    ("n=2", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("unknown model", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("unknown module", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "module_ids": ["nope"]}, 400, None),
    ("bad recovery", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "recovery": "magic"}, 400, None),
    ("past the window", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, None),
    # fields we do not implement that would change the output: refused by name, never ignored
    ("bad response_format", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("unusable schema", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     400, "response_format"),
    ("tools", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ("tool_choice", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400, "tool_choice"),
    ("logprobs", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ("penalty", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("unknown field", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_new_tokenz": 5}, 400, "max_new_tokenz"),
]


def test_bad_requests_get_openai_errors_and_the_server_stays_up(client, base_url):
    import openai

    with httpx.Client(base_url=base_url, timeout=60) as http:
        for what, body, status, param in BAD:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (what, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}, what
            if param is not None:
                assert err["param"] == param, (what, err)
        long = http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        unknown_field = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}],
                                                                "max_tokens": 2, "frequency_penalty": 0, "user": "x"})
        assert unknown_field.status_code == 200  # fields that cannot change the output are accepted
        neutral = {"metadata": {"a": "b"}, "store": False, "parallel_tool_calls": None, "response_format": {"type": "text"},
                   "tools": None, "logprobs": False, "logit_bias": {}, "service_tier": "auto"}
        assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2, **neutral}).status_code == 200
        echo = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True})
        assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo", echo.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    with pytest.raises(openai.BadRequestError, match="Invalid type: foo") as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    assert e.value.body["param"] == "response_format"
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], **GREEDY)
    assert "purple" in r.choices[0].message.content.lower()


def test_an_internal_failure_is_a_500_for_that_request_and_the_server_stays_up(client, base_url, corpus_path, server_log):
    # A real fault inside the request: the corpus's module table goes missing under the running server
    # (retrieval reads it), then comes back. Only the requests in between fail.
    ask = lambda: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[2]}], **GREEDY).choices[0].message.content
    before = ask()
    db = sqlite3.connect(corpus_path / "chunks.sqlite", isolation_level=None)
    db.execute("ALTER TABLE modules RENAME TO modules_away")
    try:
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 4})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and "internal error" in error["message"]
        # the client gets a request id, never the exception's text; the log has the traceback under that id
        rid = r.headers["x-request-id"]
        assert rid in error["message"] and "modules" not in error["message"] and "sqlite" not in error["message"].lower()
        logged = server_log.read_text()
        assert f"request id {rid}" in logged and "Traceback" in logged and "no such table: modules" in logged
        assert httpx.get(f"{base_url}/health").status_code == 200
    finally:
        db.execute("ALTER TABLE modules_away RENAME TO modules")
        db.close()
    assert ask() == before


def test_serve_command_help_and_a_missing_corpus(capsys, tmp_path):
    from rag_promptcache.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(o in out for o in ("--corpus", "--host", "--port", "--k", "--max-batch", "--max-queue",
                                                        "--api-key", "RAG_PROMPTCACHE_API_KEY", "--shutdown-timeout"))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--corpus", str(tmp_path / "nope")])
    assert e.value.code == 1 and "does not exist" in capsys.readouterr().err


def test_structured_output_from_langchain_and_the_openai_client(client, base_url):
    # with_structured_output sends response_format json_schema (strict); the server decodes under the
    # schema's grammar, so the client's parser gets an object that validates
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Fruit(BaseModel):
        colour: str
        island: str

    lc = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=64, max_retries=0)
    fruit = lc.with_structured_output(Fruit).invoke("What colour is the zorblat, and on which island does it grow?")
    assert isinstance(fruit, Fruit) and fruit.colour and fruit.island
    raw = lc.with_structured_output(Fruit, include_raw=True).invoke(QUESTIONS[0])
    assert raw["parsing_error"] is None and Fruit.model_validate_json(raw["raw"].content) == raw["parsed"]

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[2]}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=256)
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTIONS[2]}], stream=True, temperature=0, max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "Built", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert set(json.loads(text)) == {"year"} and isinstance(json.loads(text)["year"], int), text


def test_tools_are_refused_by_name_not_ignored(base_url):
    # tool calls are not implemented: a client binding tools gets a 400 naming the field, never free text
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Lookup(BaseModel):
        """Look a fruit up."""

        name: str

    lc = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=12, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="tools") as e:
        lc.bind_tools([Lookup]).invoke(QUESTIONS[0])
    assert e.value.body["param"] == "tools"


def test_embeddings_with_the_openai_client_and_langchain(client, base_url):
    import base64

    import numpy as np
    from langchain_openai import OpenAIEmbeddings

    from rag_promptcache.rag import Embedder

    texts = ["The zorblat is purple.", "Castle Varn has a bell."]
    local = Embedder().embed(texts)  # the corpus's embedder, loaded here: the reference
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), local, atol=1e-5)
    tokens = Embedder().model.tokenizer(texts)["input_ids"]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in tokens)
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0], encoding_format="float", dimensions=384)
    np.testing.assert_allclose(one.data[0].embedding, local[0], atol=1e-5)

    raw = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="<f4")  # OpenAI's layout
    np.testing.assert_allclose(decoded, local[1], atol=1e-5)

    lc = OpenAIEmbeddings(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", check_embedding_ctx_length=False)
    np.testing.assert_allclose(lc.embed_documents(texts), local, atol=1e-5)
    np.testing.assert_allclose(lc.embed_query(texts[1]), local[1], atol=1e-5)


EMBED_BAD = [
    ("token ids", {"input": [1, 2, 3]}, "input", "token-id"),
    ("token id lists", {"input": [[1, 2], [3]]}, "input", "token-id"),
    ("empty list", {"input": []}, "input", "empty"),
    ("empty string", {"input": ["ok", " "]}, "input", "[1]"),
    ("too long", {"input": ["short", "word " * 600]}, "input", "limit of"),
    ("dimensions", {"input": "hi", "dimensions": 64}, "dimensions", "384"),
    ("bad format", {"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ("unknown field", {"input": "hi", "truncate": True}, "truncate", "unknown field"),
]


def test_embeddings_refuse_what_they_cannot_do_by_name(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for what, body, param, says in EMBED_BAD:
            r = http.post("/v1/embeddings", json={"model": MODEL, **body})
            assert r.status_code == 400, (what, r.text)
            err = r.json()["error"]
            assert err["param"] == param and says in err["message"], (what, err)
        assert http.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "hi"}).status_code == 404
