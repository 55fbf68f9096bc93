"""Lazy module KV: `ingest --kv lazy` chunks, embeds and indexes, and the store starts empty; a question
encodes what it retrieves (once, however many ask at once), the answer equals an eager corpus's; `info`,
`warm` (resumable) and `/metrics` say how much is encoded; faults during a lazy fill (a full disk, Redis
going away, two processes filling one corpus) cost a recompute, never an answer or an entry.

Over a 2-layer random Llama with SmolLM2's tokenizer (tests/tiny_llama.py) and the real MiniLM embedder."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rag_promptcache.rag import Corpus
from rag_promptcache.rag.budget import StoreBudget
from rag_promptcache.store import DiskStore
from rag_promptcache.store import disk as disk_module
from tiny_llama import tiny_llama_and_records

TOPICS = {
    "rivers.txt": "The Nile flows north through eleven countries into the Mediterranean Sea. ",
    "volcanoes.txt": "Lava cools into basalt rock when it meets the sea near an erupting volcano. ",
    "bees.txt": "Honey bees dance in a figure eight to tell the hive where the flowers are. ",
    "glaciers.txt": "Glaciers carve U-shaped valleys as the ice grinds slowly over the bedrock. ",
}
QUESTIONS = ["Which way does the Nile flow?", "What does lava cool into?", "Why do bees dance?",
             "What shape of valley does a glacier carve?"]


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[str, Path, object]:
    return tiny_llama_and_records(tmp_path_factory, TOPICS, 24)


def build(parts, path: Path, **kw) -> Corpus:
    model, docs, emb = parts
    return Corpus.build([docs], path, model=model, embedder=emb, chunk_tokens=64, progress=False, redis_url="", **kw)


def held_bytes(path: Path) -> int:
    store = DiskStore(path / "store")
    try:
        return store.stats().num_bytes
    finally:
        store.close()


def test_a_lazy_corpus_starts_empty_and_answers_as_an_eager_one(parts, tmp_path: Path, monkeypatch) -> None:
    # the cached path: on a tiny model the timed cost model may run a question as full prefill (tests/conftest.py)
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")
    eager, lazy = build(parts, tmp_path / "e"), build(parts, tmp_path / "l", kv="lazy")
    try:
        assert lazy.manifest.kv == "lazy" and lazy.info()["kv"] == "lazy"
        assert held_bytes(tmp_path / "l") == 0 and lazy.coverage().num_encoded == 0
        assert len(lazy) == len(eager) and eager.coverage().share == 1.0
        for q in QUESTIONS[:2]:
            first = lazy.ask(q, k=3, max_new_tokens=8)  # its misses computed in its prefill, not waited for
            assert first.served == "deferred" and set(first.deferred_modules) == set(first.missed_modules) != set()
            lazy.store_deferred()  # what the background encoder does while no request runs
            a, b = eager.ask(q, k=3, max_new_tokens=8), lazy.ask(q, k=3, max_new_tokens=8)
            assert a.answer == b.answer and a.module_ids == b.module_ids
            assert not a.missed_modules and not b.missed_modules and b.served == "store"
        again = lazy.ask(QUESTIONS[0], k=3, max_new_tokens=8)
        assert not again.missed_modules and set(again.hit_modules) == set(again.module_ids)
        cov = lazy.coverage()
        assert 0 < cov.num_encoded < cov.num_modules and 0 < cov.share < 1
        assert lazy.info()["encoded"]["num_encoded"] == cov.num_encoded
    finally:
        eager.close()
        lazy.close()
    reopened = Corpus.open(tmp_path / "l", embedder=parts[2])  # counted from the disk tier, no model loaded
    assert reopened.coverage() == cov and reopened.engine_slot.loaded is None
    reopened.close()


def test_metrics_say_how_much_of_a_lazy_corpus_is_encoded(parts, tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from rag_promptcache.server.metrics import Metrics, Watched

    c = build(parts, tmp_path / "c", kv="lazy")
    batcher = c.engine.scheduler(max_batch=1)
    metrics = Metrics([Watched("c", batcher, c.engine, lambda: c.store, c.coverage)])

    def gauges() -> dict[str, float]:
        text = metrics.render()[0].decode()
        return {s.name.removeprefix("rag_promptcache:"): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name.startswith("rag_promptcache:corpus_")}

    try:
        before = gauges()
        assert before["corpus_modules_encoded"] == 0 and before["corpus_modules"] == len(c) > 0
        answer = c.ask(QUESTIONS[2], k=2, max_new_tokens=4)
        assert c.engine.background.wait_done(timeout=120)  # stored while no request is in flight
        after = gauges()
        assert after["corpus_modules_encoded"] == len(answer.module_ids)
        assert 0 < after["corpus_tokens_encoded"] < after["corpus_tokens"]
    finally:
        batcher.close()
        c.close()


def test_warm_encodes_the_most_retrieved_and_resumes(parts, tmp_path: Path, capsys) -> None:
    from test_cli import run

    corpus = build(parts, tmp_path / "c", kv="lazy")
    corpus.close()
    log = tmp_path / "questions.jsonl"
    log.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS * 2) + "\n")
    code, out, err = run(capsys, "warm", "--corpus", tmp_path / "c", "--questions", log, "--top", "3", "-k", "2")
    assert code == 0, err
    assert "3 module(s) encoded" in out and "3 of" in out
    code, out, err = run(capsys, "warm", "--corpus", tmp_path / "c", "--questions", log, "--top", "5", "-k", "2")
    assert code == 0 and "2 module(s) encoded" in out and "3 of the 5 wanted already stored" in out
    # by what questions retrieved: nothing yet, then what `ask` recorded
    code, _, err = run(capsys, "warm", "--corpus", tmp_path / "c")
    assert code == 1 and "no question has retrieved" in err
    c = Corpus.open(tmp_path / "c", embedder=parts[2])
    for q in QUESTIONS:
        c.retrieve(q, k=2)
    c.close()
    code, out, err = run(capsys, "warm", "--corpus", tmp_path / "c", "--top", "8")
    assert code == 0, err
    code, out, _ = run(capsys, "info", "--corpus", tmp_path / "c", "--json")
    assert json.loads(out)["encoded"]["num_encoded"] >= 5
    code, out, err = run(capsys, "warm", "--corpus", tmp_path / "c", "--all")  # the rest, hot ones first
    assert code == 0, err
    total = json.loads(run(capsys, "info", "--corpus", tmp_path / "c", "--json")[1])["encoded"]
    assert total["num_encoded"] == total["num_modules"] and f"{total['num_modules']} modules encoded" in out
    code, out, _ = run(capsys, "warm", "--corpus", tmp_path / "c", "--all")
    assert code == 0 and "0 module(s) encoded" in out


def test_ingest_prints_both_modes_and_a_budget_below_one_module_is_refused(parts, tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    from test_cli import assert_user_error, run

    from rag_promptcache.rag import ingest

    monkeypatch.setattr(ingest, "LARGE_INGEST_TOKENS", 1)
    model, docs, _ = parts
    args = ["ingest", docs, "--model", model, "--chunk-tokens", "64"]
    assert_user_error(run(capsys, *args, "--corpus", tmp_path / "a", "--store-budget", "disk=16KiB"),
                      "smaller than one module")
    assert not (tmp_path / "a").exists()
    assert_user_error(run(capsys, *args, "--corpus", tmp_path / "a", "--store-budget", "attic=1GiB"),
                      "TIER one of memory, disk, redis")
    assert_user_error(run(capsys, *args, "--corpus", tmp_path / "a", "--kv", "sometimes"), "valid modes: eager, lazy")
    code, out, err = run(capsys, *args, "--corpus", tmp_path / "a", "--kv", "lazy", "--store-budget", "disk=2MiB")
    assert code == 0, err
    assert "expected store growth per codec" in err and "lazy (this ingest): 0 B now" in err and "disk 2.0 MiB" in err
    assert "kv lazy: 0 of" in out
    info = json.loads(run(capsys, "info", "--corpus", tmp_path / "a", "--json")[1])
    assert info["budget"]["disk"] == 2 * 2**20 and info["kv"] == "lazy"
    code, _, err = run(capsys, *args, "--corpus", tmp_path / "b", "--store-budget", "disk=64KiB")
    assert code == 0 and "eager encoding would evict most of it as it is written" in err
    def native(said: str) -> float:  # the native codec's expected size, in MiB
        size, unit = said.split("native ", 1)[1].split(",")[0].split()
        return float(size) * {"KiB": 2**-10, "MiB": 1.0, "GiB": 2**10}[unit]

    one = native(err)
    # a corpus keeping two entries a module: twice the store, the plain half written now
    code, _, err = run(capsys, *args, "--corpus", tmp_path / "c", "--neighbours", "2", "--neighbours-present", "1")
    assert code == 0 and "eager (this ingest): the plain entries (half) now, the rest in idle time" in err
    assert native(err) == pytest.approx(2 * one, rel=0.1)  # as printed: one decimal


def test_a_budget_lowered_between_runs_is_held_and_said(parts, tmp_path: Path, capsys) -> None:
    from test_cli import run

    c = build(parts, tmp_path / "c", budget=StoreBudget(disk=8 * 2**20))
    full = held_bytes(tmp_path / "c")
    c.close()
    smaller = full // 2
    code, _, err = run(capsys, "ingest", parts[1], "--corpus", tmp_path / "c", "--store-budget", f"disk={smaller}")
    assert code == 0, err
    assert "changed: disk 8.0 MiB ->" in err
    assert 0 < held_bytes(tmp_path / "c") <= smaller
    c = Corpus.open(tmp_path / "c", embedder=parts[2])
    assert c.budget.disk == smaller
    assert c.ask(QUESTIONS[0], k=3, max_new_tokens=4).answer is not None  # whatever was evicted is recomputed
    c.close()
    assert held_bytes(tmp_path / "c") <= smaller


def test_a_disk_that_fills_during_a_lazy_fill_costs_recomputes_not_answers(parts, tmp_path: Path, monkeypatch) -> None:
    c = build(parts, tmp_path / "c", kv="lazy")
    first = c.ask(QUESTIONS[0], k=2, max_new_tokens=6)  # writes while there is room
    writes = {"n": 0}

    def full(path: Path, data: bytes) -> None:
        writes["n"] += 1
        with open(path, "xb") as f:
            f.write(data[: len(data) // 3])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(disk_module, "_write_bytes", full)
    answers = [c.ask(q, k=2, max_new_tokens=6) for q in QUESTIONS[1:]]
    assert writes["n"] > 0 and all(a.answer is not None for a in answers)
    # the fills the answers queued run on the encoder's thread: the disk stays full until they are done, and
    # the store is read only after (a write in flight leaves its .tmp file until it is renamed)
    assert c.engine.background.wait_done(timeout=120), c.engine.background.stats()
    monkeypatch.undo()
    store = DiskStore(tmp_path / "c" / "store")
    assert store.verify().bad_keys == () and not list((tmp_path / "c" / "store").glob("??/.tmp-*"))
    store.close()
    assert c.ask(QUESTIONS[0], k=2, max_new_tokens=6).answer == first.answer
    c.close()


def test_redis_going_away_mid_fill_answers_by_recompute(parts, tmp_path: Path, own_redis) -> None:
    model, docs, emb = parts
    Corpus.build([docs], tmp_path / "c", model=model, embedder=emb, chunk_tokens=64, progress=False,
                 redis_url=own_redis.url, kv="lazy").close()
    c = Corpus.open(tmp_path / "c", embedder=emb, redis_url=own_redis.url, disk_tier=False)
    first = c.ask(QUESTIONS[0], k=2, max_new_tokens=6)
    assert first.missed_modules
    own_redis.stop()
    down = [c.ask(q, k=2, max_new_tokens=6) for q in QUESTIONS[1:3]]
    assert all(a.answer is not None for a in down)
    own_redis.start()
    c.close()
    c = Corpus.open(tmp_path / "c", embedder=emb, redis_url=own_redis.url, disk_tier=False)
    assert c.ask(QUESTIONS[0], k=2, max_new_tokens=6).answer == first.answer
    c.close()


def test_one_module_missed_by_two_requests_at_once_is_encoded_once(parts) -> None:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store import MemoryStore

    class MeetingStore(MemoryStore):
        """Both requests miss the module before either claims it."""

        barrier = threading.Barrier(2, timeout=60)
        met: set[str] = set()

        def get(self, key):
            kv = super().get(key)
            me = threading.current_thread().name
            if kv is None and me.startswith("asker") and me not in self.met:  # each one's first miss
                self.met.add(me)
                self.barrier.wait()
            return kv

    pc = PromptCache.from_pretrained(parts[0], store=MeetingStore(), prefix_cache_bytes=0, recovery="none")
    pc.add_schema('<schema name="s"><module name="a">The Nile flows north into the sea.</module>'
                  '<module name="b">Lava cools into basalt.</module></schema>')
    encoded: list[int] = []
    real = pc.planner.encode
    pc.planner.encode = lambda units: encoded.append(len(units)) or real(units)
    results = {}

    def ask(i: int) -> None:
        results[i] = pc.generate('<prompt schema="s"><a/><b/><user>Where?</user></prompt>', max_new_tokens=3)

    threads = [threading.Thread(target=ask, args=(i,), name=f"asker-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the prompt's units (the schema's root text, a, b): each encoded by one request, waited for by the other
    assert sum(encoded) == 3 and encoded.count(0) == len(encoded) - 1 and pc.planner.num_shared_encodes == 3
    assert results[0].token_ids == results[1].token_ids
    assert results[0].missed_modules == results[1].missed_modules == ("a", "b")
    assert pc.generate('<prompt schema="s"><a/><b/><user>Where?</user></prompt>', max_new_tokens=3).missed_modules == ()


FILL = """
import sys
from rag_promptcache.rag import Corpus
c = Corpus.open(sys.argv[1])
for q in sys.argv[2:]:
    c.ask(q, k=3, max_new_tokens=4)
    c.store_deferred()  # the background encoder's queue, written now: both processes write the store
    print("stored", flush=True)
c.close()
"""


def test_two_processes_filling_one_lazy_corpus_leave_no_corrupt_entry(parts, tmp_path: Path) -> None:
    build(parts, tmp_path / "c", kv="lazy", budget=StoreBudget(disk=6 * 2**20)).close()
    env = {**os.environ, "RAG_PROMPTCACHE_REDIS_URL": ""}
    procs = [subprocess.Popen([sys.executable, "-c", FILL, str(tmp_path / "c"), *QUESTIONS[i::2], *QUESTIONS],
                              env=env, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    store = DiskStore(tmp_path / "c" / "store")
    report = store.verify()
    assert report.bad_keys == () and report.num_checked > 0 and store.stats().num_bytes <= 6 * 2**20
    store.close()
    c = Corpus.open(tmp_path / "c", embedder=parts[2])
    assert c.coverage().num_encoded == report.num_checked - 1  # every entry a module's, and the root
    c.close()


def test_a_process_killed_while_storing_deferred_modules_leaves_the_store_consistent(parts, tmp_path: Path,
                                                                                    monkeypatch) -> None:
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")  # the last question reads the store (tests/conftest.py)
    build(parts, tmp_path / "c", kv="lazy").close()
    env = {**os.environ, "RAG_PROMPTCACHE_REDIS_URL": ""}
    proc = subprocess.Popen([sys.executable, "-c", FILL, str(tmp_path / "c"), *QUESTIONS * 3], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "stored", proc.stderr.read()
    proc.kill()  # during a later question or its modules' writes
    proc.communicate(timeout=60)
    store = DiskStore(tmp_path / "c" / "store")
    report = store.verify()
    assert report.bad_keys == () and report.num_checked > 0
    store.close()
    c = Corpus.open(tmp_path / "c", embedder=parts[2])
    answer = c.ask(QUESTIONS[0], k=3, max_new_tokens=4)  # reads what was written whole
    assert answer.hit_modules and answer.finish_reason  # (a tiny random model's answer may be empty)
    c.close()


def test_idle_time_refills_what_questions_came_back_to_and_nothing_else(parts, tmp_path: Path) -> None:
    import shutil

    c = build(parts, tmp_path / "c", kv="lazy")
    try:
        twice = set(c.ask(QUESTIONS[0], k=2, max_new_tokens=2).module_ids)
        assert set(c.ask(QUESTIONS[0], k=2, max_new_tokens=2).module_ids) == twice
        once = set(c.ask(QUESTIONS[3], k=2, max_new_tokens=2).module_ids) - twice
        assert once, "the second question should retrieve a module the first did not"
    finally:
        c.close()  # the retrieval log is kept in the table; the store is dropped below (a new machine, a wipe)
    shutil.rmtree(tmp_path / "c" / "store")
    c = Corpus.open(tmp_path / "c", embedder=parts[2], redis_url="")
    try:
        engine = c.prepare()
        c.warm_when_idle()  # what `serve` does at start-up: no question asked in this process yet
        assert engine.background.wait_done(timeout=120)
        name = c.manifest.name
        assert all(engine.is_cached(name, m) for m in twice)  # retrieved twice: hot
        assert not any(engine.is_cached(name, m) for m in once)  # retrieved once: not worth a forward
        stats = engine.background.stats()
        assert stats.num_failed == 0 and stats.num_queued == 0
    finally:
        c.close()


def test_the_ingest_estimate_is_the_real_chunkers_count_on_a_sample(tokenizer, tmp_path: Path, monkeypatch) -> None:
    """The 4-bytes-a-token guess ran 20% high on HTML manuals; the estimate now chunks a sample for real."""
    from rag_promptcache.rag import ingest
    from rag_promptcache.rag.chunker import Chunker, ChunkParams
    from rag_promptcache.rag.loaders import load
    from rag_promptcache.rag.sample import topic_texts

    for name, text in topic_texts().items():
        (tmp_path / f"{name}.txt").write_text(text)
    docs = list(load([tmp_path]))
    chunker = Chunker(tokenizer, ChunkParams(256, 32))
    real = sum(c.num_tokens for d in docs for c in chunker.chunks(d.blocks(), d.label))
    guess = sum(ingest.estimate_tokens(docs).values())
    monkeypatch.setattr(ingest, "SAMPLE_BYTES", 40_000)  # a tenth of the topics: a sample, not all of them
    counted = ingest.count_tokens(docs, chunker)
    assert abs(counted - real) / real < 0.05, (counted, real, guess)
    assert abs(counted - real) < abs(guess - real)


def test_prepare_packs_the_answering_forward_before_the_first_question(parts, tmp_path: Path) -> None:
    from rag_promptcache.engine.compute import runner

    c = build(parts, tmp_path / "c", kv="lazy")
    try:
        engine = c.prepare()  # what ask, chat and serve call before a question
        assert runner._LEAN.get(engine.model) is not None  # packed now, not in the first answer's TTFT (0.2 s)
    finally:
        c.close()


def test_warm_all_of_a_corpus_with_no_modules_says_so(parts, tmp_path: Path) -> None:
    c = build(parts, tmp_path / "c", kv="lazy")
    try:
        for d in c.table.documents():
            c.remove(d.source)
        assert len(c) == 0
        for top in (None, 5):  # --all, --top 5: nothing to rank, and nothing to warm either way
            with pytest.raises(ValueError, match="the corpus holds no modules"):
                c.warm(top)
    finally:
        c.close()
