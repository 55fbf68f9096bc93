"""One server, many corpora: `serve --corpus fruit --corpus rails` in a subprocess, driven by the official
`openai` client. Each corpus answers from its own documents (a question only one can answer, asked of
both), both are listed by /v1/models, an unknown or ambiguous name is OpenAI's 404, concurrent requests
to both run in the one batcher of the one model they share, and /metrics labels their series by corpus.

In process: `open_corpora` loads the model once for corpora built with it, and each corpus's modules go
to its own store (its own disk tier), not the other's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import _idle, build_corpus, client, start_server  # noqa: F401 - client: the fixture, over base_url here

pytestmark = [pytest.mark.smollm, pytest.mark.slow]
FRUIT = {
    "zorblat.txt": "The zorblat is a purple fruit that grows only on the island of Quenti. "
    "It tastes like lemon and honey.\n\nFarmers harvest zorblats in the month of Ember.",
    "castle.txt": "Castle Varn was built in 1342 by the glassmakers' guild. Its tower is 61 metres tall "
    "and its bell rings at dawn.",
}
RAILS = {
    "trains.md": "# Trains\n\nThe Blue Line train leaves the central station every 12 minutes. "
    "It stops at Harbor, Museum and Airport.",
    "ferries.txt": "The night ferry to Osk departs from pier 4 at 23:10 and takes nine hours.",
}
ZORBLAT = "What colour is the zorblat?"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def corpora(smollm, tmp_path_factory) -> tuple[Path, Path]:
    home = tmp_path_factory.mktemp("kb")
    return (build_corpus(smollm, tmp_path_factory.mktemp("fruit-docs"), home / "fruit", FRUIT),
            build_corpus(smollm, tmp_path_factory.mktemp("rails-docs"), home / "rails", RAILS))


@pytest.fixture(scope="module")
def base_url(corpora, tmp_path_factory):
    fruit, rails = corpora
    proc, url = start_server(fruit, tmp_path_factory.mktemp("log") / "server.log", "--corpus", str(rails),
                             "--k", "2", "--max-batch", "2")
    yield url
    proc.terminate()
    proc.wait(30)


def _labels(response) -> set[str]:
    return {s["label"] for s in response.model_extra["sources"]}


def test_models_lists_each_corpus_with_its_model_schema_and_size(client, corpora):
    from rag_promptcache.rag.layout import read_manifest

    cards = client.models.list().data
    assert [m.id for m in cards] == ["fruit", "rails"]
    for card, path in zip(cards, corpora):
        assert card.model_extra["schema"] == read_manifest(path).name
        assert card.model_extra["root"] == "smollm2-135m-instruct"
        assert card.model_extra["num_documents"] == 2 and card.model_extra["num_modules"] >= 2
        assert card.model_extra["num_tokens"] > 0


def test_a_question_only_one_corpus_can_answer_is_answered_from_each_ones_own_documents(client):
    ask = {"messages": [{"role": "user", "content": ZORBLAT}], **GREEDY}
    fruit = client.chat.completions.create(model="fruit", **ask)
    rails = client.chat.completions.create(model="rails", **ask)
    assert fruit.model == "fruit" and rails.model == "rails"
    assert _labels(fruit) <= set(FRUIT) and "zorblat.txt" in _labels(fruit)
    assert _labels(rails) and _labels(rails) <= set(RAILS)
    assert "purple" in fruit.choices[0].message.content.lower()
    assert "purple" not in rails.choices[0].message.content.lower()
    # and the other way round: only rails knows the Blue Line
    blue = client.chat.completions.create(model="rails", messages=[{"role": "user", "content":
                                          "How often does the Blue Line train leave?"}], **GREEDY)
    assert "trains.md" in _labels(blue) and "12" in blue.choices[0].message.content


def test_each_corpus_answers_to_its_schema_name_and_an_unknown_or_shared_name_is_404(client, corpora):
    import openai

    from rag_promptcache.rag.layout import read_manifest

    schema = read_manifest(corpora[1]).name
    r = client.chat.completions.create(model=schema, messages=[{"role": "user", "content": ZORBLAT}], **GREEDY)
    assert _labels(r) <= set(RAILS)
    for name, says in (("nope", "unknown model 'nope'"), ("smollm2-135m-instruct", "names 2 corpora")):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], **GREEDY)
        error = e.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model", error
        assert says in error["message"] and "'fruit', 'rails'" in error["message"], error
    # the embedder's name still picks an embedder for /v1/embeddings (both corpora embed alike)
    assert len(client.embeddings.create(model="all-MiniLM-L6-v2", input="zorblat").data[0].embedding) == 384


def test_requests_to_both_corpora_decode_together_in_the_one_batcher_of_their_model(base_url):
    health = httpx.get(f"{base_url}/health").json()
    assert health["models"] == ["fruit", "rails"] and health["num_batchers"] == 1
    seen: list[dict] = []
    body = {"messages": [{"role": "user", "content": ZORBLAT}], "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        streams = []
        for model in ("fruit", "rails"):
            cm = http.stream("POST", "/v1/chat/completions", json={**body, "model": model})
            resp = cm.__enter__()
            assert resp.status_code == 200
            streams.append((cm, resp.iter_lines()))
        deadline = time.monotonic() + 120
        while (h := httpx.get(f"{base_url}/health").json())["running"] < 2:  # both decoding in the one batch
            assert time.monotonic() < deadline, h
            time.sleep(0.05)
        seen.append(h)
        for cm, lines in streams:
            assert any(line.startswith("data:") for line in lines)  # each got its own stream
            cm.__exit__(None, None, None)
    assert seen[0]["running"] == 2 and seen[0]["waiting"] == 0


def test_concurrent_answers_from_both_corpora_are_their_one_at_a_time_answers(client):
    questions = [("fruit", ZORBLAT), ("rails", "Where does the Blue Line stop?"), ("fruit", "When was Castle Varn built?"),
                 ("rails", "When does the night ferry to Osk depart?")]

    def ask(model: str, q: str) -> str:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                              **GREEDY).choices[0].message.content

    alone = [ask(m, q) for m, q in questions]
    together: list[str | None] = [None] * len(questions)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(*questions[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_metrics_label_each_corpus_series(client, base_url):
    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(model="rails", messages=[{"role": "user", "content": ZORBLAT}], **GREEDY)
    client.chat.completions.create(model="fruit", messages=[{"role": "user", "content": ZORBLAT}], **GREEDY)
    # the modules the questions computed are stored by the background encoder once no request runs
    assert _idle(base_url, timeout=120)["background_queue"] == 0
    samples = [s for f in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text) for s in f.samples]

    def of(name: str, **labels: str) -> list[float]:
        return [s.value for s in samples if s.name == f"rag_promptcache:{name}"
                and all(s.labels.get(k) == v for k, v in labels.items())]

    for corpus in ("fruit", "rails"):
        assert of("corpus_modules", corpus=corpus)[0] >= 2
        assert 1 <= of("corpus_modules_encoded", corpus=corpus)[0] <= of("corpus_modules", corpus=corpus)[0]
        assert sum(of("store_hits_total", corpus=corpus, tier="all") + of("store_misses_total", corpus=corpus, tier="all")) > 0
        assert sum(of("request_success_total", corpus=corpus)) >= 1
        assert of("time_to_first_token_seconds_count", corpus=corpus)[0] >= 1
    assert {s.labels["tier"] for s in samples if s.name == "rag_promptcache:store_bytes_total"
            or s.name == "rag_promptcache:store_bytes"} >= {"all", "memory", "disk"}
    assert len(of("num_requests_running")) == 1  # one gauge for the server, summed over its batchers


def test_open_corpora_shares_the_model_and_keeps_each_corpus_modules_in_its_own_store(smollm, corpora, tmp_path):
    import shutil

    from rag_promptcache.rag import layout
    from rag_promptcache.rag.corpora import close_corpora, open_corpora

    copies = []
    for path in corpora:  # fresh copies: the server fixture's process writes into the originals
        copies.append(tmp_path / "kb" / path.name)
        shutil.copytree(path, copies[-1], ignore=shutil.ignore_patterns("store"))  # no KV yet
    fruit, rails = opened = open_corpora([tmp_path / "kb"])  # a folder of corpora
    try:
        assert [c.path.name for c in opened] == ["fruit", "rails"]
        assert fruit.engine is rails.engine  # one model loaded
        assert fruit.store is not rails.store
        answer = rails.ask(ZORBLAT, k=2, max_new_tokens=4)
        assert set(answer.deferred_modules) == set(answer.module_ids)  # computed in the question, stored after it
        rails.store_deferred()  # what the shared model's background encoder does while no request runs
        keys = {m: key for m, key, _ in rails.table.module_keys()}
        assert {keys[m] for m in answer.module_ids} <= layout.store_keys(copies[1])  # into rails's own disk tier
        assert layout.store_keys(copies[0]) == set()  # nothing of rails's went to fruit's store
        assert rails.coverage().num_encoded == len(answer.module_ids) and fruit.coverage().num_encoded == 0
        fruit.ask(ZORBLAT, k=2, max_new_tokens=4)
        fruit.store_deferred()
        assert fruit.coverage().num_encoded == 2 and rails.coverage().num_encoded == len(answer.module_ids)
    finally:
        close_corpora(opened)


def test_two_corpora_with_one_name_or_one_schema_are_refused(corpora, tmp_path):
    import shutil

    from rag_promptcache.rag.corpora import open_corpora
    from rag_promptcache.rag.layout import find_corpora

    (tmp_path / "a").mkdir()
    shutil.copytree(corpora[0], tmp_path / "a" / "fruit")
    with pytest.raises(ValueError, match="have one name"):
        find_corpora([corpora[0], tmp_path / "a" / "fruit"])
    with pytest.raises(ValueError, match="given twice"):
        find_corpora([corpora[0], corpora[0]])
    shutil.copytree(corpora[0], tmp_path / "fruit2")
    with pytest.raises(ValueError, match="are one corpus"):
        open_corpora([corpora[0], tmp_path / "fruit2"])
    with pytest.raises(ValueError, match="does not exist"):
        find_corpora([tmp_path / "missing"])
