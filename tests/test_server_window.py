"""The server and a prompt the context window cannot take: a 400 in OpenAI's `context_length_exceeded`
shape for chat (a question too long, or one that leaves under `MIN_ANSWER_TOKENS` for the answer) and
for completions, never a 200 with an answer of a token or two; and a response's sources name the
section (`where`: "file › section"). In process (the real app, scheduler and engine over a 2-layer
random Llama with a 512-token window and the real MiniLM embedder); answers are noise, the shapes are
what is checked."""

from __future__ import annotations

import json

import pytest

from rag_promptcache.rag.retrieval import MIN_ANSWER_TOKENS
from tests.tiny_llama import build_tiny_corpus

pytestmark = pytest.mark.slow
WINDOW = 512
# sections long enough to be chunks of their own at the default chunk size
DOCS = {"guide.md": "# Guide\n\n## Install\n\n" + "Run make install to set the kettle up. " * 12 + "\n\n## Usage\n\n"
                    + "Call ask with a question about the kettle. " * 12}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from starlette.testclient import TestClient

    from rag_promptcache.server import build

    app, (batcher,), (chat,) = build(build_tiny_corpus(tmp_path_factory, DOCS, WINDOW), k=2)
    try:
        with TestClient(app) as client:
            yield client, chat.corpus
    finally:
        batcher.close()
        chat.corpus.close()


def words(n: int) -> str:
    return " ".join(["word"] * n)  # one token a word to SmolLM2's tokenizer


def chat(client, question: str, **extra):
    return client.post("/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": question}], **extra})


def assert_too_long(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "context_length_exceeded")
    assert f"{WINDOW}-token" in error["message"] and "max_new_tokens" not in error["message"]
    return error


def test_a_question_past_the_window_is_a_400_naming_its_tokens(http):
    client, corpus = http
    error = assert_too_long(chat(client, words(2000)), "messages")
    assert "the question is 2000 tokens, too long" in error["message"]
    assert client.get("/health").json()["status"] == "ok"


def test_a_question_that_leaves_a_few_tokens_for_the_answer_is_refused_not_answered_in_them(http):
    client, corpus = http
    count = corpus.engine.tokenizer.encode
    assert len(count(words(100), add_special_tokens=False)) == 100
    # what else takes the window: the instructions, the chat template (about 32), the best chunk (at most the largest)
    others = len(count(corpus.manifest.instructions, add_special_tokens=False)) + 32 + max(corpus.table.module(m)[1] for m, _ in corpus.table.modules())
    question = words(WINDOW - others - 10)  # leaves 10 to 10 + (the chunks' difference) for the answer, under the least
    error = assert_too_long(chat(client, question), "messages")
    assert "too long for the model's" in error["message"] and "shorten the question to at most" in error["message"]
    r = client.post("/v1/completions", json={"model": "c", "prompt": words(WINDOW - MIN_ANSWER_TOKENS // 2)})
    error = assert_too_long(r, "prompt")
    assert f"under the least an answer is given ({MIN_ANSWER_TOKENS})" in error["message"]
    assert_too_long(client.post("/v1/completions", json={"model": "c", "prompt": words(4000)}), "prompt")


def test_an_unset_max_tokens_is_cut_to_what_the_window_leaves_and_the_answer_says_so(http):
    client, corpus = http
    r = client.post("/v1/completions", json={"model": "c", "prompt": words(WINDOW - 3 * MIN_ANSWER_TOKENS), "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 3 * MIN_ANSWER_TOKENS  # the window's rest, as OpenAI's default


def test_sources_name_the_file_and_the_section(http):
    client, _ = http
    r = chat(client, "How do I install the kettle?", max_tokens=2)
    assert r.status_code == 200, r.text
    sources = r.json()["sources"]
    # k = 2 of the document's two chunks: the first starts at the title (the chunker carries a short
    # opening section into the next), the second is the Usage section
    assert {s["where"] for s in sources} == {"guide.md › Guide", "guide.md › Guide › Usage"}, sources
    top = next(s for s in sources if s["section"] == "Guide")
    assert top["label"] == "guide.md" and top["snippet"].startswith("Run make install")  # heading lines dropped
    streamed = client.post("/v1/chat/completions", json={"model": "c", "stream": True, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "How do I install the kettle?"}]})
    first = json.loads(streamed.text.split("data: ", 2)[1].split("\n", 1)[0])
    assert {s["where"] for s in first["sources"]} == {"guide.md › Guide", "guide.md › Guide › Usage"}
