"""Two replica processes over one corpus, sharing module KV through a real redis-server.

Each replica is `Corpus.open` in its own Python process, with memory → Redis (no disk tier, so only
Redis can carry a module from one to the other) and the Redis URL from $RAG_PROMPTCACHE_REDIS_URL,
as any command that opens a corpus would get it. A module encoded by one is served to the other
from Redis; when Redis dies, questions are still answered (recomputed), with no error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.corpus_store import ENV_REDIS_URL, redis_prefix
from tests.store_helpers import needs_redis
from tests.tiny_llama import build_tiny_corpus

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
REPLICA = r"""
import json, sys
from rag_promptcache.rag.corpus import Corpus

c = Corpus.open(sys.argv[1], disk_tier=False)
c.prepare()
print(json.dumps({"redis_url": c.redis_url}), flush=True)
for line in sys.stdin:
    a = c.ask(line.strip(), k=2, max_new_tokens=2)
    stored = c.engine.background.wait_done(timeout=120)  # a miss is written to the store after its answer
    redis = c.engine.store.tier_stats()[-1]
    print(json.dumps({"hit": a.hit_modules, "missed": a.missed_modules, "cached": a.cached_tokens, "stored": stored,
                      "redis_hits": redis.num_hits, "redis_errors": redis.num_errors}), flush=True)
"""
DOCS = {
    "cats.txt": "Cats sleep sixteen hours a day. A cat purrs when it is content.",
    "bread.txt": "Sourdough bread rises with wild yeast fed with flour and water.",
    "tides.txt": "Tides follow the moon; spring tides come at new and full moon.",
    "zebra.txt": "Zebras have stripes that confuse biting flies.",
}


class Replica:
    def __init__(self, corpus: Path, redis_url: str) -> None:
        # the cached path, which reads the store: the cost model may send a small prompt to full prefill
        env = {**os.environ, ENV_REDIS_URL: redis_url, "RAG_PROMPTCACHE_FALLBACK": "never",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", REPLICA, str(corpus)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"replica exited: {self.proc.wait()} {self.proc.stderr.read()[-2000:]}"
        return json.loads(line)

    def ask(self, question: str) -> dict:
        self.proc.stdin.write(question + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> str:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0
        return self.proc.stderr.read()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return build_tiny_corpus(tmp_path_factory, DOCS)


@needs_redis
def test_a_module_encoded_by_one_replica_is_served_from_redis_to_the_other(corpus: Path, own_redis) -> None:
    one, two = Replica(corpus, own_redis.url), Replica(corpus, own_redis.url)  # both load at once
    try:
        assert one.read()["redis_url"] == two.read()["redis_url"] == own_redis.url
        first = one.ask("Why do zebras have stripes?")
        assert first["missed"] and not first["hit"] and first["redis_hits"] == 0  # nobody had it: encoded here
        assert first["stored"]  # and written to memory and Redis once the answer was out
        second = two.ask("Why do zebras have stripes?")
        assert sorted(second["hit"]) == sorted(first["missed"]) and not second["missed"]  # no recompute
        assert second["redis_hits"] == len(second["hit"]) + 1  # the modules and the instructions, from Redis
        import redis

        client = redis.Redis.from_url(own_redis.url)
        prefix = redis_prefix(Corpus.open(corpus).manifest.name)
        assert client.hlen(f"{prefix}:index") == len(first["missed"]) + 1  # keyed under this corpus's prefix

        own_redis.stop()  # Redis goes away mid-run
        third = two.ask("What makes sourdough rise?")  # the bread module is not in two's memory: recompute, no error
        assert third["missed"] and not set(third["missed"]) & set(first["missed"]) and third["redis_errors"] >= 1
        again = one.ask("Why do zebras have stripes?")  # still in one's memory tier
        assert again["hit"] and not again["missed"]
    finally:
        logs = [r.close() for r in (one, two)]
    assert "Traceback" not in "".join(logs) and "unreachable" in logs[1]


def test_a_bad_redis_url_is_refused(corpus: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="not a Redis URL; valid forms"):
        Corpus.open(corpus, redis_url="localhost:6379")
    monkeypatch.setenv(ENV_REDIS_URL, "http://x")
    with pytest.raises(ValueError, match=f"\\${ENV_REDIS_URL}"):
        Corpus.open(corpus)
