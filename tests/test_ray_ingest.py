"""`ingest --ray` on a local Ray cluster started here: the same corpus as a local ingest, resumable
with or without Ray, a worker killed mid-batch retried, a batch that keeps failing reported; with
`--neighbours`, the same neighbour lists, store keys and KV as a local ingest (batches in flight searched
too, a changed document's drop after them), resumable without Ray, a failed batch failing those behind it.

A tiny random-weight llama (SmolLM2's tokenizer, hidden 64) keeps each actor's model load short;
the embedder is the real all-MiniLM-L6-v2. One cluster (2 CPUs) for the module.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from rag_promptcache.cli import main
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.corpus_store import redis_prefix
from rag_promptcache.rag.distributed import Fault, RayOptions
from rag_promptcache.store import DiskStore, RedisStore
from tests.store_helpers import needs_redis
from tests.tiny_llama import save_tiny_llama

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TOPICS = {
    "cats.txt": "Cats sleep sixteen hours a day. A cat purrs when it is content and when it is hurt. " * 3,
    "volcanoes.md": "# Volcanoes\n\nMagma rises through the crust. Basalt flows are runny; rhyolite is thick. " * 3,
    "bread.txt": "Sourdough bread rises with wild yeast. The starter is fed flour and water every day. " * 3,
    "tides.txt": "Tides follow the moon. Spring tides come at new and full moon; neap tides in between. " * 3,
    "zebra.txt": "Zebras have stripes that confuse biting flies. Each zebra's pattern is unique. " * 3,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    for name, text in TOPICS.items():
        (root / name).write_text(text)
    return root


@pytest.fixture(autouse=True)
def small_batches(monkeypatch) -> None:
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 3)  # several batches, so several actors and commits


def build(docs: Path, where: Path, model: str, ray_opts: RayOptions | None = None, **kw) -> Corpus:
    return Corpus.build([docs], where, model=model, chunk_tokens=32, progress=False, ray=ray_opts, **kw)


@pytest.fixture(scope="module")
def reference(docs: Path, tiny_model: str, tmp_path_factory) -> Corpus:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_mod, "BATCH_CHUNKS", 3)
        c = build(docs, tmp_path_factory.mktemp("ref") / "c", tiny_model)
    yield c
    c.close()


def snapshot(c: Corpus) -> dict[str, object]:
    """Everything that must match between two builds of the same files: rows, vectors, store keys."""
    db = c.table.db
    index = c.index.index
    ids = faiss.vector_to_array(index.id_map).astype(np.int64)
    vectors = index.index.reconstruct_n(0, len(ids))
    order = np.argsort(ids)
    return {
        "modules": sorted(db.execute("SELECT module_id, faiss_id, text, num_tokens FROM modules")),
        "chunks": sorted(db.execute("SELECT source, module_id, seq, start, end FROM chunks")),
        "documents": sorted((d.source, d.content_hash, d.complete) for d in c.table.documents()),
        "faiss_ids": ids[order].tolist(),
        "vectors": vectors[order],
        "store_keys": sorted(DiskStore(c.path / "store").keys()),
    }


def assert_same(a: Corpus, b: Corpus) -> None:
    sa, sb = snapshot(a), snapshot(b)
    np.testing.assert_allclose(sa.pop("vectors"), sb.pop("vectors"), atol=1e-5)
    assert sa == sb


@needs_redis
def test_ray_ingest_builds_the_same_corpus(cluster, docs: Path, tiny_model: str, reference: Corpus, tmp_path: Path,
                                           redis_server) -> None:
    c = build(docs, tmp_path / "c", tiny_model, RayOptions(workers=2), redis_url=redis_server.url)
    report = c.last_report
    assert report.workers == 2 and report.kv_written_by == "workers" and not report.failed  # a local cluster shares the disk
    assert report.num_modules == len(reference) > 6
    assert_same(c, reference)
    # The workers wrote every entry into the corpus's Redis tier as well, under its own prefix.
    redis_keys = RedisStore(redis_server.url, prefix=redis_prefix(c.manifest.name)).keys()
    assert sorted(redis_keys) == snapshot(reference)["store_keys"]
    store = DiskStore(c.path / "store")
    key = store.keys()[0]
    torch.testing.assert_close(store.get(key).keys, DiskStore(reference.path / "store").get(key).keys, rtol=0, atol=0)
    # the cached path, whichever path this machine's timed cost model would pick for a prompt this small
    c.engine.fallback = "never"
    answer = c.ask("Why do zebras have stripes?", k=2, max_new_tokens=4)
    assert answer.hit_modules and not answer.missed_modules
    c.close()


def test_interrupted_ray_ingest_resumes_without_ray(cluster, docs: Path, tiny_model: str, reference: Corpus, tmp_path: Path) -> None:
    commits = []

    def stop_after_two(num_modules: int, num_tokens: int) -> None:
        commits.append(num_modules)
        if len(commits) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # KV returned to the driver this time
        build(docs, tmp_path / "c", tiny_model, RayOptions(workers=1, kv="driver"), on_batch=stop_after_two)
    partial = Corpus.open(tmp_path / "c")
    before = len(partial)
    assert 0 < before < len(reference) and partial.info()["num_incomplete"] > 0
    report = partial.add([docs], progress=False)  # no Ray
    assert report.workers == 0 and report.num_modules == len(reference) - before
    assert_same(partial, reference)
    partial.engine.fallback = "never"  # the cached path, whichever path the timed cost model would pick here
    answer = partial.ask("What makes sourdough rise?", k=2, max_new_tokens=4)
    assert answer.hit_modules and not answer.missed_modules
    partial.close()


def test_killed_worker_is_retried(cluster, docs: Path, tiny_model: str, reference: Corpus, tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    fault = Fault("Tides follow the moon", action="exit", once_file=str(killed))
    c = build(docs, tmp_path / "c", tiny_model, RayOptions(workers=1, kv="driver", fault=fault))
    assert killed.exists(), "the fault never fired: the test did not kill a worker"
    assert not c.last_report.failed and c.info()["num_incomplete"] == 0
    assert_same(c, reference)
    c.close()


def test_batch_that_keeps_failing_is_reported_with_its_file(cluster, docs: Path, tiny_model: str, reference: Corpus,
                                                           tmp_path: Path, capsys) -> None:
    fault = Fault("Magma rises", action="raise")
    c = build(docs, tmp_path / "c", tiny_model, RayOptions(workers=1, max_retries=1, fault=fault))
    report = c.last_report
    bad = str((docs / "volcanoes.md").resolve())
    assert [f for f, _ in report.failed] == [bad] and "injected failure" in report.failed[0][1]
    assert "FAILED 1 file(s)" in report.summary() and bad in report.summary()
    incomplete = [d.source for d in c.table.documents() if not d.complete]
    assert incomplete == [bad] and len(c.table.documents()) == len(TOPICS)  # the rest is kept
    c.close()
    # The next ingest retries it: the CLI, on Ray again (this cluster), KV returned to the driver.
    with pytest.raises(SystemExit) as exit_:
        main(["ingest", str(docs), "--corpus", str(tmp_path / "c"), "--ray", "--workers", "1", "--ray-kv", "driver"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "1 ingested, 4 unchanged" in out and "KV returned to the driver" in out
    c = Corpus.open(tmp_path / "c")
    assert_same(c, reference)
    c.close()


def test_options_are_checked() -> None:
    for bad, match in (({"workers": 0}, "workers must be at least 1"), ({"kv": "nfs"}, "valid: auto, workers, driver"),
                       ({"cpus_per_worker": 0}, "cpus_per_worker must be > 0")):
        with pytest.raises(ValueError, match=match):
            RayOptions(**bad)
    with pytest.raises(ValueError, match="valid: raise, exit"):
        Fault("x", action="crash")


def test_workers_that_cannot_load_the_model_are_a_clear_error(cluster, reference: Corpus, tmp_path: Path) -> None:
    import json

    shutil.copytree(reference.path, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["model"] = str(tmp_path / "no-such-model")  # the workers load it by this name
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "lighthouse.txt").write_text("A lighthouse keeper trims the lamp's wick every night.")
    c = Corpus.open(tmp_path / "c", engine=reference.engine)  # the driver has the right weights
    with pytest.raises(ValueError, match="the Ray workers could not start: .*no-such-model"):
        c.add([tmp_path / "new"], progress=False, ray=RayOptions(workers=1))
    # Nothing lost and nothing half-done: the workers fail before the first document is started.
    assert len(c) == len(reference) and [d.source for d in c.table.documents()] == [d.source for d in reference.table.documents()]
    c.close()


# -- with neighbours (`--neighbours 2`): batches of 3 on 2 workers, so up to 4 in flight when a batch is chosen for


def numbered(text: str, n: int) -> str:
    """`text`'s first two sentences in turn, each numbered: n sentences, n chunks, no two alike."""
    return " ".join(f"{text.split('. ')[i % 2]} (note {i})." for i in range(n))


def write_numbered(root: Path) -> Path:
    for name, text in TOPICS.items():
        (root / name).write_text(numbered(text, 8))
    return root


@pytest.fixture(scope="module")
def nbr_docs(tmp_path_factory) -> Path:
    return write_numbered(tmp_path_factory.mktemp("nbr-docs"))


@pytest.fixture(scope="module")
def nbr_reference(nbr_docs: Path, tiny_model: str, tmp_path_factory) -> Corpus:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_mod, "BATCH_CHUNKS", 3)
        c = build(nbr_docs, tmp_path_factory.mktemp("nbr-ref") / "c", tiny_model, neighbours=2, codec="native")
    yield c
    c.close()


def assert_same_neighbours(a: Corpus, b: Corpus, fp16: bool = False) -> None:
    """`a` is `b` (rows, vectors, keys) with the same neighbour lists and the same KV under every key:
    bit for bit, or `b`'s rounded to fp16 where `a`'s went to the driver (as fp16) on the way."""
    assert_same(a, b)
    assert a.table.neighbours() == b.table.neighbours()
    assert sorted(a.table.module_keys()) == sorted(b.table.module_keys())
    sa, sb = DiskStore(a.path / "store"), DiskStore(b.path / "store")
    for key in sb.keys():
        ka, kb = sa.get(key), sb.get(key)
        for x, y in ((ka.keys, kb.keys), (ka.values, kb.values)):
            assert torch.equal(x.float(), y.half().float() if fp16 else y), key


@pytest.mark.parametrize("kv", ["workers", "driver"])
def test_ray_ingest_with_neighbours_builds_the_same_corpus(cluster, nbr_docs: Path, tiny_model: str, nbr_reference: Corpus,
                                                           tmp_path: Path, kv: str) -> None:
    near = nbr_reference.table.neighbours()
    order = [m for m, _ in nbr_reference.table.modules()]
    assert len(order) > 15 and all(len(near[m]) == 2 for m in order)
    if kv == "workers":
        c = build(nbr_docs, tmp_path / "c", tiny_model, RayOptions(workers=2, kv=kv), neighbours=2, codec="native")
    else:  # the CLI takes --neighbours with --ray
        with pytest.raises(SystemExit) as exit_:
            main(["ingest", str(nbr_docs), "--corpus", str(tmp_path / "c"), "--model", tiny_model, "--chunk-tokens", "32",
                  "--codec", "native", "--neighbours", "2", "--ray", "--workers", "2", "--ray-kv", "driver"])
        assert exit_.value.code == 0
        c = Corpus.open(tmp_path / "c")
    try:
        assert c.manifest.neighbours == 2
        if kv == "workers":
            assert c.last_report.kv_written_by == "workers" and not c.last_report.failed
        assert_same_neighbours(c, nbr_reference, fp16=kv == "driver")
    finally:
        c.close()


def test_ray_ingest_keeping_both_entries_writes_the_plain_ones_and_warm_writes_the_rest(
        cluster, nbr_docs: Path, tiny_model: str, nbr_reference: Corpus, tmp_path: Path) -> None:
    c = build(nbr_docs, tmp_path / "c", tiny_model, RayOptions(workers=2, kv="workers"), neighbours=2,
              neighbours_present=2, codec="native")
    try:
        assert c.last_report.kv_written_by == "workers" and not c.last_report.failed
        assert c.table.neighbours() == nbr_reference.table.neighbours()
        assert sorted(c.table.module_keys()) == sorted(nbr_reference.table.module_keys())
        plain, after = ({k for _, k, _ in c.table.module_keys(plain=p)} for p in (True, False))
        held = set(DiskStore(c.path / "store").keys())
        assert len(plain) == len(after) == len(c) and plain <= held and not after & held  # the workers wrote the plain ones
        assert c.coverage().num_after_neighbours == 0
        assert c.warm(None).num_encoded == len(c)  # the entries after the neighbours: a local ingest's, bit for bit
        ours, theirs = DiskStore(c.path / "store"), DiskStore(nbr_reference.path / "store")
        for _, key, _ in nbr_reference.table.module_keys():
            a, b = ours.get(key), theirs.get(key)
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), key
    finally:
        c.close()


def test_interrupted_ray_ingest_with_neighbours_resumes_without_ray(cluster, nbr_docs: Path, tiny_model: str,
                                                                   nbr_reference: Corpus, tmp_path: Path) -> None:
    commits = []

    def stop_after_two(num_modules: int, num_tokens: int) -> None:
        commits.append(num_modules)
        if len(commits) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(nbr_docs, tmp_path / "c", tiny_model, RayOptions(workers=2, kv="workers"), neighbours=2, codec="native",
              on_batch=stop_after_two)
    partial = Corpus.open(tmp_path / "c")
    try:
        before = len(partial)
        assert 0 < before < len(nbr_reference) and partial.info()["num_incomplete"] > 0
        report = partial.add([nbr_docs], progress=False)  # no Ray
        assert report.workers == 0 and report.num_modules == len(nbr_reference) - before
        assert_same_neighbours(partial, nbr_reference)
    finally:
        partial.close()


def test_a_changed_document_on_ray_with_neighbours_is_a_local_ingests_change(cluster, tiny_model: str, tmp_path: Path) -> None:
    """A changed document drops its old modules when it starts; the batches sent before it (a new document's,
    whose nearest modules are the old ones) are committed first, then encoded again without them, as locally."""
    (tmp_path / "docs").mkdir()
    docs = write_numbered(tmp_path / "docs")
    local = build(docs, tmp_path / "local", tiny_model, neighbours=2, codec="native")
    local.close()
    shutil.copytree(tmp_path / "local", tmp_path / "ray")
    # one batch (3 chunks), sent before zebra.txt starts: zebra.txt's first three chunks' text under another title
    (docs / "a_stripes.txt").write_text(numbered(TOPICS["zebra.txt"], 3))
    (docs / "zebra.txt").write_text("Zebras live in herds on the African savanna and graze on grass all day.")
    on_ray = Corpus.open(tmp_path / "ray")
    local = Corpus.open(tmp_path / "local")
    try:
        on_ray.add([docs], progress=False, ray=RayOptions(workers=2, kv="workers"))
        local.add([docs], progress=False)
        assert on_ray.last_report.num_ingested == 2 and not on_ray.last_report.failed
        assert_same_neighbours(on_ray, local)
        stripes = local.table.chunk_ids(str((docs / "a_stripes.txt").resolve()))
        near = local.table.neighbours()
        assert len(stripes) == 3 and any(len(near.get(m, ())) < 2 for m in stripes)  # it named some of the old zebra's
        assert all(local.table.has_module(n) for ns in local.table.neighbours().values() for n in ns)
    finally:
        on_ray.close()
        local.close()


def assert_whole(c: Corpus) -> None:
    """Every chunk's module and every neighbour named is in the table, and every module's recorded key is the
    one the corpus schema compiles, its KV stored."""
    db = c.table.db
    assert db.execute("SELECT COUNT(*) FROM chunks WHERE module_id NOT IN (SELECT module_id FROM modules)").fetchone()[0] == 0
    assert all(c.table.has_module(n) for ns in c.table.neighbours().values() for n in ns)
    keys = {m: k for m, k, _ in c.table.module_keys()}
    assert c.engine.store_keys(c.manifest.name, [m for m, _ in c.table.modules()]) == keys
    store = DiskStore(c.path / "store")
    assert all(store.contains(k) for k in keys.values())


def test_a_failed_batch_with_neighbours_fails_those_sent_behind_it(cluster, nbr_docs: Path, tiny_model: str,
                                                                   tmp_path: Path) -> None:
    fault = Fault("Magma rises through the crust (note 0)", action="raise")
    c = build(nbr_docs, tmp_path / "c", tiny_model, RayOptions(workers=2, max_retries=0, fault=fault), neighbours=2,
              codec="native")
    try:
        why = dict(c.last_report.failed)
        assert "injected failure" in why.pop(str((nbr_docs / "volcanoes.md").resolve()))
        assert why and all("sent while a batch that failed was in flight" in w for w in why.values())
        assert_whole(c)
        assert {d.source for d in c.table.documents() if not d.complete} == {*why, str((nbr_docs / "volcanoes.md").resolve())}
        report = c.add([nbr_docs], progress=False)  # no Ray: the failed files again
        assert report.num_ingested == len(why) + 1 and c.info()["num_incomplete"] == 0
        assert_whole(c)
    finally:
        c.close()
