"""Corpus bookkeeping with a fake engine and embedder: build, open, resume, update, delete, ask.

The fakes (`FakeEngine`, `FakeEmbedder`) are shared with tests/test_cli.py."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from rag_promptcache.engine.planning.background import Activity, BackgroundEncoder
from rag_promptcache.engine.result import EncodeReport, Result, Stream
from rag_promptcache.pml import ast
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.corpus import Corpus


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(hashlib.md5(t.encode()).hexdigest()[:6], 16) for t in re.findall(r"\s*\w{1,6}|\s*[^\w\s]|\s+", text)]


class FakeEngine:
    """Records encodes in a dict standing in for the store; answers by echoing the imports."""

    def __init__(self, fingerprint: str = "fake-fp", model_name: str = "fake-model") -> None:
        self.tokenizer = FakeTokenizer()
        self.fingerprint = fingerprint
        self.model_name = model_name
        self.mode = "isolated"
        self.context_window = 4096
        self.schemas: dict[str, ast.Schema] = {}
        self.stored: dict[str, str] = {}  # module text -> module id (content-addressed, like the store)
        self.encode_calls: list[str] = []
        self.prompts: list[str] = []
        self.store = self  # closed by a corpus that loaded this engine
        # no miss is ever deferred here (nothing is planned): the real encoder, with nothing to do
        self.background = BackgroundEncoder(lambda units: [], self, Activity())  # type: ignore[arg-type]

    def close(self) -> None:
        pass

    def ready_to_answer(self, pack: bool = True) -> None:
        pass

    def store_of(self, schema_name: str) -> FakeEngine:  # one store for every schema, as an engine with none attached
        return self.store

    def add_schema(self, schema: ast.Schema, replace: bool = False) -> ast.Schema:
        self.schemas[schema.name] = schema
        return schema

    def encode(self, schema_name: str, module_names=None, progress=None) -> EncodeReport:
        schema = self.schemas[schema_name]
        module_names = list(schema.modules) if module_names is None else module_names
        todo = [n for n in module_names if schema.modules[n].children[0].text not in self.stored]
        for n in todo:
            self.stored[schema.modules[n].children[0].text] = n
            self.encode_calls.append(n)
        return EncodeReport(len(todo), 10 * len(todo), len(module_names) - len(todo), 0.0)

    def store_keys(self, schema_name: str, module_names) -> dict[str, str]:  # the engine's store keys, over the fake store
        modules = self.schemas[schema_name].modules
        return {m: hashlib.sha256(modules[m].children[0].text.encode()).hexdigest() for m in module_names}

    def delete(self, key: str) -> bool:
        text = next((t for t in self.stored if hashlib.sha256(t.encode()).hexdigest() == key), None)
        return text is not None and self.stored.pop(text) is not None

    def full_prefill_ttft(self, prompt: str) -> float:
        return 0.5

    def stream(self, prompt: str, **sampling) -> Stream:
        self.prompts.append(prompt)
        self.sampling = sampling
        imports = re.findall(r"<(m[0-9a-f]{16})/>", prompt)

        def gen():
            yield "echo: "
            yield " ".join(imports)
            return Result("echo: " + " ".join(imports), (1, 2), "eos", 0.01, 0.02, 100, 90, 10, tuple(imports), (), ())

        return Stream(gen())


class FakeEmbedder:
    name = "fake-embedder"
    dim = 64

    def embed(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest()[:4], 16) % self.dim] += 1.0
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)
        return out


TOPICS = {
    "cats.txt": "Cats are small carnivorous mammals. They sleep for most of the day.\n\n"
    "A cat purrs when it is content. Cats groom themselves with their rough tongues.\n\n" * 3,
    "rivers.md": "# Rivers\n\nThe Nile is a major river in Africa. It flows north into the Mediterranean Sea.\n\n"
    "The Amazon carries more water than any other river on Earth.\n\n" * 3,
    "sub/volcano.txt": "Volcanoes erupt when magma rises to the surface. Lava cools into rock.\n\n" * 5,
}


def write_docs(root: Path, docs: dict[str, str] = TOPICS) -> Path:
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    return write_docs(tmp_path / "docs")


def build(docs: Path, where: Path, engine: FakeEngine | None = None, **kw) -> Corpus:
    return Corpus.build([docs], where, engine=engine or FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=32, overlap=8, progress=False, **kw)


def stop_after(num_batches: int):
    """An `on_batch` that interrupts the ingest (as Ctrl-C does) once `num_batches` batches are committed."""
    seen = []

    def on_batch(num_modules: int, num_tokens: int) -> None:
        seen.append(num_modules)
        if len(seen) == num_batches:
            raise KeyboardInterrupt

    return on_batch


def snapshot(c: Corpus) -> tuple:
    rows = c.table.db.execute("SELECT source, module_id, seq, start, end FROM chunks ORDER BY source, seq").fetchall()
    mods = c.table.db.execute("SELECT module_id, faiss_id, text, num_tokens, vector FROM modules ORDER BY module_id").fetchall()
    return rows, mods, sorted(d.source for d in c.table.documents() if d.complete), len(c.index)


def test_build_search_text_source(docs: Path, tmp_path: Path) -> None:
    c = build(docs, tmp_path / "c")
    info = c.info()
    assert info["num_documents"] == 3 and info["num_modules"] == len(c) > 3 and info["num_incomplete"] == 0
    hits = c.search("which river flows into the Mediterranean", k=3)
    assert len(hits) == 3 and all(isinstance(m, str) and isinstance(s, float) for m, s in hits)
    assert "Nile" in c.text(hits[0][0]) and c.source(hits[0][0]).endswith("rivers.md")
    assert not c.text(hits[0][0]).startswith("[")  # the label stays in the module, not the text
    schema = c.schema
    assert isinstance(schema.children[0], ast.Role) and set(schema.modules) == {m for m, _ in c.table.modules()}
    with pytest.raises(ValueError, match="k must be at least 1"):
        c.search("x", k=0)


def test_ask_imports_retrieved_modules_best_last(docs: Path, tmp_path: Path) -> None:
    engine = FakeEngine()
    c = build(docs, tmp_path / "c", engine)
    answer = c.ask("what do cats do all day?", k=2, history=[("hi <there>", "hello & welcome")])
    # module_ids and sources stay in retrieval order (best first); the prompt puts the best next to
    # the question (docs/FIDELITY.md)
    assert answer.answer == "echo: " + " ".join(reversed(answer.module_ids))
    assert len(answer.module_ids) == 2 and answer.sources[0] == "cats.txt"
    prompt = engine.prompts[-1]
    assert prompt.startswith(f'<prompt schema="{c.manifest.name}"><{answer.module_ids[1]}/><{answer.module_ids[0]}/>')
    assert "<user>hi &lt;there&gt;</user><assistant>hello &amp; welcome</assistant><user>what do cats" in prompt
    assert c.manifest.name in engine.schemas  # the full schema was registered for the question
    stream = c.ask_stream("volcano lava", k=1)
    assert "".join(stream).startswith("echo: ") and stream.answer is not None and stream.answer.sources == ("sub/volcano.txt",)
    d = answer.to_dict()
    assert {"answer", "module_ids", "sources", "ttft_s", "cached_tokens", "computed_tokens", "missed_modules"} <= set(d)


def test_open_checks_model_and_embedder(docs: Path, tmp_path: Path) -> None:
    build(docs, tmp_path / "c").close()
    with pytest.raises(ValueError, match="'fake-model'.*'other-model'"):
        Corpus.open(tmp_path / "c", model="other-model")
    with pytest.raises(ValueError, match="fake-model.*fake-fp.*other.*other-fp"):
        Corpus.open(tmp_path / "c", FakeEngine("other-fp", "other"))
    with pytest.raises(ValueError, match="'fake-embedder', not 'all-MiniLM-L6-v2'"):
        Corpus.open(tmp_path / "c", embedder="sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(ValueError, match="is not a corpus"):
        Corpus.open(docs)
    with pytest.raises(ValueError, match="does not exist"):
        Corpus.open(tmp_path / "nope")
    with pytest.raises(ValueError, match="chunk_tokens=32, not 64"):
        Corpus.build([docs], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=64)


def test_reingest_unchanged_is_a_noop(docs: Path, tmp_path: Path) -> None:
    engine = FakeEngine()
    c = build(docs, tmp_path / "c", engine)
    before, calls = snapshot(c), len(engine.encode_calls)
    report = c.add([docs], progress=False)
    assert report.num_unchanged == 3 and report.num_ingested == 0 and report.num_modules == 0
    assert snapshot(c) == before and len(engine.encode_calls) == calls


def test_update_and_delete(docs: Path, tmp_path: Path) -> None:
    c = build(docs, tmp_path / "c")
    (docs / "cats.txt").write_text("Dogs bark at the mail carrier every morning.\n\n")
    (docs / "sub" / "volcano.txt").unlink()
    report = c.add([docs], progress=False)
    assert (report.num_ingested, report.num_removed, report.num_unchanged) == (1, 1, 1)
    texts = " ".join(c.text(m) for m, _ in c.table.modules())
    assert "Dogs bark" in texts and "purrs" not in texts and "Volcano" not in texts
    assert len(c) == c.info()["num_modules"]  # vectors follow modules
    assert c.search("dogs mail", k=1)[0][0] in {m for m, _ in c.table.modules()}
    dropped = c.remove(docs / "rivers.md")
    assert dropped > 0 and len(c) == c.info()["num_modules"] == 1
    with pytest.raises(ValueError, match="no document"):
        c.remove(docs / "rivers.md")
    c.close()
    reopened = Corpus.open(tmp_path / "c", FakeEngine(), embedder=FakeEmbedder())
    assert len(reopened) == 1


def test_interrupted_ingest_resumes_to_the_same_corpus(docs: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 4)
    many = {f"d{i}.txt": f"Document {i} talks about topic {i}. " * 12 + "\n\n" + f"Second part {i}. " * 10 for i in range(6)}
    write_docs(docs, many)
    reference = build(docs, tmp_path / "ref")

    engine = FakeEngine()
    with pytest.raises(KeyboardInterrupt):
        build(docs, tmp_path / "c", engine, on_batch=stop_after(2))
    interrupted_calls = list(engine.encode_calls)
    partial = Corpus.open(tmp_path / "c", engine, embedder=FakeEmbedder())
    assert 0 < len(partial) < len(reference) and partial.info()["num_incomplete"] > 0
    report = partial.add([docs], progress=False)
    assert report.num_unchanged + report.num_ingested == report.num_documents
    assert snapshot(partial)[:3] == snapshot(reference)[:3] and len(partial) == len(reference)
    # nothing encoded twice: the store already held every module of the interrupted batches
    assert len(engine.encode_calls) == len(set(engine.encode_calls))
    assert set(interrupted_calls) < set(engine.encode_calls)


def test_index_rebuilt_when_behind_the_table(docs: Path, tmp_path: Path) -> None:
    c = build(docs, tmp_path / "c")
    n = len(c)
    c.close()
    (tmp_path / "c" / "index.faiss").unlink()
    with pytest.warns(UserWarning, match="index.faiss is missing"):  # rebuilt once and saved (test_retrieval_hybrid.py)
        assert len(Corpus.open(tmp_path / "c", FakeEngine(), embedder=FakeEmbedder())) == n


def test_identical_chunks_are_one_module(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    write_docs(root, {"a.txt": "Same paragraph here.\n\n" * 4 + "Other text.\n\n"})
    c = Corpus.build([root, root / "a.txt"], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=16, overlap=0, progress=False)
    assert c.info()["num_modules"] == len(set(m for m, _ in c.table.modules()))


def test_langchain_and_llamaindex_objects(tmp_path: Path) -> None:
    class LCDoc:
        def __init__(self, text, source):
            self.page_content, self.metadata = text, {"source": source}

    class LINode:
        id_ = "node-7"
        metadata: dict = {}

        def get_content(self):
            return "LlamaIndex node about penguins in Antarctica."

    c = Corpus.build([LCDoc("LangChain doc about owls at night.", "owls.pdf"), LINode()], tmp_path / "c",
                     engine=FakeEngine(), embedder=FakeEmbedder(), progress=False)
    assert {d.source for d in c.table.documents()} == {"owls.pdf", "node-7"}
    assert "penguins" in c.text(c.search("penguins", k=1)[0][0])


def test_budget_refuses_huge_input_before_loading_anything(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus_mod, "_load_engine", lambda *a: pytest.fail("engine loaded"))
    (tmp_path / "big.txt").write_text("word " * 10_000)
    with pytest.raises(ValueError, match="exceeds the ingest budget"):
        Corpus.build([tmp_path / "big.txt"], tmp_path / "c", embedder=FakeEmbedder(), token_budget=1000)
    assert not (tmp_path / "c").exists()


def test_a_damaged_index_is_rebuilt_and_saved_once(docs: Path, tmp_path: Path) -> None:
    import warnings

    from rag_promptcache.rag.corpus import CorpusWarning

    n = len(build(docs, tmp_path / "c"))
    (tmp_path / "c" / "index.faiss").write_bytes(b"not a faiss index")
    with pytest.warns(CorpusWarning, match="is damaged"):
        assert len(Corpus.open(tmp_path / "c", FakeEngine(), embedder=FakeEmbedder())) == n
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorpusWarning)  # the rebuilt index was saved: no warning the second time
        c = Corpus.open(tmp_path / "c", FakeEngine(), embedder=FakeEmbedder())
    assert len(c) == n and c.search("volcano lava", 1)


def test_a_missing_chunk_table_is_named_as_missing(docs: Path, tmp_path: Path) -> None:
    build(docs, tmp_path / "c").close()
    (tmp_path / "c" / "chunks.sqlite").unlink()
    with pytest.raises(ValueError, match=r"chunks.sqlite is missing.*re-ingest"):
        Corpus.open(tmp_path / "c", FakeEngine(), embedder=FakeEmbedder())
    assert not (tmp_path / "c" / "chunks.sqlite").exists()  # opening did not leave an empty table behind
