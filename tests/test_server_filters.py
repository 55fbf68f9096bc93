"""The chat request's `filter` field on the real server (`serve` in a subprocess over a tiny random-weight
Llama's corpus and the real embedder), driven by the official `openai` client through `extra_body`: the
answer's sources come only from matching chunks, k of them when k match, a filter matching nothing answers
"Not found in the documents." without generating, streaming carries the same sources, and a bad filter is a
400 in OpenAI's error shape naming `filter` while the server stays up. The schema documents the field."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from rag_promptcache.rag.retrieval import NOT_FOUND
from tests.test_server import start_server
from tests.tiny_llama import build_tiny_corpus

pytestmark = [pytest.mark.slow]
DOCS = {
    "zorblat.md": "---\nyear: 2019\nteam: farm\n---\n# Zorblat\n\n" + "The zorblat is a purple fruit that grows on the island of Quenti. " * 8 + "\n\n"
                  + "## Harvest\n\nFarmers harvest zorblats in the month of Ember.\n",
    "trains.md": "---\nyear: 2024\nteam: transit\n---\n# Trains\n\nThe Blue Line train leaves every 12 minutes.\n",
    "castle.txt": "Castle Varn was built in 1342. Its bell rings at dawn, when the zorblat farmers wake.",
}
QUESTION = [{"role": "user", "content": "When are zorblats harvested?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    corpus = build_tiny_corpus(tmp_path_factory, DOCS, max_positions=512)
    proc, url = start_server(corpus, tmp_path_factory.mktemp("log") / "server.log", "--k", "2")
    yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), url
    proc.terminate()
    proc.wait(timeout=30)


def labels(response) -> list[str]:
    return [s["label"] for s in response.model_extra["sources"]]


def test_the_filter_field_narrows_retrieval(client) -> None:
    openai, _ = client
    ask = lambda flt, **kw: openai.chat.completions.create(model="c", messages=QUESTION, max_tokens=4,  # noqa: E731
                                                           extra_body={"filter": flt, **kw})
    assert set(labels(ask({"team": "transit"}))) == {"trains.md"}
    harvest = ask({"section": "Harvest"})
    assert labels(harvest) == ["zorblat.md"] and "Ember" in harvest.model_extra["sources"][0]["snippet"]
    assert labels(ask({"year": {"$lt": 2024}}, k=3)) == ["zorblat.md", "zorblat.md"]  # castle.txt has no year
    assert sorted(labels(ask({"team": {"$nin": ["transit"]}}, k=3))) == ["castle.txt", "zorblat.md", "zorblat.md"]
    assert set(labels(ask({"$or": [{"source": {"$glob": "*.txt"}}, {"year": 2024}]}, k=2))) == {"castle.txt", "trains.md"}
    none = ask({"year": {"$gt": 3000}})
    assert none.choices[0].message.content == NOT_FOUND and none.model_extra["sources"] == []
    chunks = list(openai.chat.completions.create(model="c", messages=QUESTION, max_tokens=4, stream=True,
                                                 extra_body={"filter": {"source": "castle.txt"}}))
    assert [s["label"] for s in chunks[0].model_extra["sources"]] == ["castle.txt"]


def test_a_bad_filter_is_a_400_naming_it_and_the_server_stays_up(client) -> None:
    openai, url = client
    for flt, needle in (({"yaer": 2019}, "unknown filter key(s) 'yaer'; valid: modified, path, section, source, team, title, type, year"),
                        ({"year": {"$between": [1, 2]}}, "unknown filter operator '$between'"),
                        ("year=2019", "filter")):
        with pytest.raises(BadRequestError) as e:
            openai.chat.completions.create(model="c", messages=QUESTION, max_tokens=4, extra_body={"filter": flt})
        error = e.value.body
        assert error["param"] == "filter" and needle in error["message"], error
    with pytest.raises(BadRequestError, match="module_ids name the modules"):
        openai.chat.completions.create(model="c", messages=QUESTION, max_tokens=4,
                                       extra_body={"filter": {"year": 2019}, "module_ids": ["m0123456789abcdef"]})
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    schema = httpx.get(f"{url}/openapi.json", timeout=5).json()
    field = schema["components"]["schemas"]["ChatRequest"]["properties"]["filter"]
    assert "$gte" in field["description"] and {"type": "object", "additionalProperties": True} in field["anyOf"]
