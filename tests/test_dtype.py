"""dtype: names, the store key per dtype, and corpora that remember the dtype they were encoded in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.model.loading import cpu_flags, dtype_name, parse_dtype, resolve_device_dtype
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.records import Manifest
from rag_promptcache.store import MemoryStore
from tests.test_rag_corpus import build as build_corpus
from tests.tiny import build


def test_dtype_names():
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float32") is torch.float32
    assert parse_dtype("Float16") is torch.float16 and parse_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'; valid: auto, float32, bfloat16, float16"):
        parse_dtype("int8")
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert resolve_device_dtype("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    assert all(isinstance(f, str) for f in cpu_flags())


def test_the_store_key_separates_dtypes(tokenizer):
    store = MemoryStore()
    schema = '<schema name="s"><module name="a">alpha beta gamma delta epsilon</module></schema>'
    prompt = '<prompt schema="s"><a/> zeta</prompt>'
    # the cached path asked for: a full prefill would not show which KV each model takes from the store
    fp32 = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=store, recovery="none",
                       fallback="never")
    bf16 = PromptCache(build("llama", vocab_size=len(tokenizer)).to(torch.bfloat16), tokenizer, store=store,
                       recovery="none", fallback="never")
    for pc in (fp32, bf16):
        pc.add_schema(schema)
    assert fp32.fingerprint != bf16.fingerprint
    assert fp32.plan(prompt).misses == ("a",)
    assert bf16.plan(prompt).misses == ("a",)  # fp32 KV is never handed to the bf16 model
    assert fp32.plan(prompt).hits == ("a",) and bf16.plan(prompt).hits == ("a",)
    assert len(store.keys()) == 2
    assert {store.get(k).keys.dtype for k in store.keys()} == {torch.float32, torch.bfloat16}


def test_a_manifest_without_dtype_is_float32_and_reopens_only_in_it(tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Cats sleep for most of the day. A cat purrs when it is content.\n")
    c = build_corpus(docs, tmp_path / "c")
    assert c.manifest.dtype == "float32" and c.info()["dtype"] == "float32"
    c.close()
    path = tmp_path / "c" / "manifest.json"
    old = json.loads(path.read_text())
    del old["dtype"]  # written before manifests had the field
    path.write_text(json.dumps(old))
    assert Manifest.from_json(path.read_text(), str(path)).dtype == "float32"
    Corpus.open(tmp_path / "c", dtype="auto").close()
    Corpus.open(tmp_path / "c", dtype="float32").close()
    with pytest.raises(ValueError, match="encoded in float32, not bfloat16"):
        Corpus.open(tmp_path / "c", dtype="bf16")


def test_cli_dtype_option(tmp_path: Path, capsys, monkeypatch):
    from test_cli import assert_user_error, run

    from rag_promptcache.rag import corpus as corpus_mod
    from tests.test_rag_corpus import FakeEmbedder, FakeEngine, write_docs

    monkeypatch.setattr(corpus_mod, "_load_engine", lambda model, store, mode, dtype=None, adapter=None: FakeEngine())
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: FakeEmbedder())
    docs = write_docs(tmp_path / "docs")
    assert_user_error(run(capsys, "ingest", docs, "--corpus", tmp_path / "x", "--dtype", "int8"), "unknown dtype 'int8'")
    code, _, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")
    assert code == 0, err
    assert_user_error(run(capsys, "ask", "cats?", "--corpus", tmp_path / "c", "--dtype", "bfloat16"),
                      "encoded in float32, not bfloat16")
    assert_user_error(run(capsys, "bench", "--dtype", "int8"), "unknown dtype 'int8'")
