"""By-product entries (engine/kv/byproduct.py): where a schema keeps them, a missed module's entry is its
request's own prefill KV, keys moved back to the module's position, written with no forward. The single
request's loop, the batcher and the full-prefill path store the same entries as the slices of a separate
full prefill (`prefill_entries`, what `eval --byproduct` and the research probe read; both go through
`byproduct.entries`, so the check that does not is the next one: a prompt read back from those entries
with recovery `none` has its full prefill's logits, where plain entries do not); a schema that encodes
modules on its own never reads one; a sliding-window model encodes its misses as before. Then a lazy
corpus chosen `--byproduct` (tests/tiny_llama.py), `eval --byproduct`, and the refusals. Tiny random
models, fp32 (tests/test_byproduct_probe.py: a prompt's first module's slice is its plain entry)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rag_promptcache.rag.byproduct_eval import prefill_entries as byproduct_entries
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.pml import parse_schema
from rag_promptcache.store import MemoryStore
from test_corpus_codec import tiny_corpus  # noqa: F401 - a fixture: a corpus over a tiny Llama
from tests.test_byproduct_probe import PROMPT, SCHEMA
from tests.tiny import build

MODULES = ("a", "b", "c")


def engine(arch: str, tokenizer, byproduct: bool = True, **kw) -> PromptCache:
    kw = {"recovery": "none", "fallback": "never", "prefix_cache_bytes": 0, **kw}
    pc = PromptCache(build(arch, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), misses="defer", **kw)
    pc.add_schema(dataclasses.replace(parse_schema(SCHEMA), byproduct=byproduct))
    return pc


def reference(pc: PromptCache, tokenizer) -> tuple[dict, torch.Tensor]:
    """The slices of `pc`'s model's full prefill of PROMPT (`prefill_entries`), and its logits: on a twin
    engine that encodes misses first (`prefill_entries` plans over the plain entries)."""
    twin = PromptCache(pc.model, tokenizer, store=MemoryStore(), recovery="none", fallback="never",
                       prefix_cache_bytes=0, misses="encode")
    twin.add_schema(SCHEMA)
    return byproduct_entries(twin, PROMPT)


def stored(pc: PromptCache) -> dict:
    keys = pc.store_keys("s", list(MODULES))
    return {m: pc.store.get(k) for m, k in keys.items()}


def _logits(pc: PromptCache, plan) -> torch.Tensor:
    out = pc.prefill(dataclasses.replace(plan, sources=None))
    release(out.cache)
    return out.logits


def _same(entries: dict, expected: dict, atol: float = 1e-5) -> None:
    for m in MODULES:
        got, want = entries[m], expected[m]
        assert got is not None, m
        assert (got.start, got.token_ids, got.mode, got.fingerprint) == (want.start, want.token_ids, want.mode,
                                                                          want.fingerprint), m
        assert torch.allclose(got.keys, want.keys, atol=atol), (m, (got.keys - want.keys).abs().max())
        assert torch.allclose(got.values, want.values, atol=atol), (m, (got.values - want.values).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox_pct25"])
def test_a_missed_modules_entry_is_its_prefills_kv_and_reads_back_as_the_full_prefill(arch, tokenizer):
    pc = engine(arch, tokenizer)
    expected, full_logits = reference(pc, tokenizer)
    first = pc.generate(PROMPT, max_new_tokens=2)
    assert set(first.deferred_modules) == set(MODULES) and first.cached_tokens == 0
    encoded: list[str] = []
    real = pc.background.encode
    pc.background.encode = lambda units: (encoded.extend(u.name for u in units), real(units))[1]
    pc.background.drain()  # what the background encoder does while no request runs
    assert pc.background.wait_done(30) and pc.background.stats().num_encoded == len(MODULES) + 1
    assert pc.background.stats().num_kept == len(MODULES)  # the instructions were encoded, the modules kept
    assert not set(encoded) & set(MODULES), encoded  # only the instructions ran a forward
    _same(stored(pc), expected)

    plan = pc.plan(PROMPT, recovery="none")
    assert set(plan.hits) >= set(MODULES) and not plan.byproducts
    own = _logits(pc, plan)
    assert torch.allclose(own, full_logits, atol=1e-4), (own - full_logits).abs().max()
    plain = engine(arch, tokenizer, byproduct=False)
    assert (_logits(plain, plain.plan(PROMPT, recovery="none", misses="encode")) - full_logits).abs().max() > 1e-3


def test_the_batcher_and_the_full_prefill_path_keep_the_same_entries(tokenizer):
    batched = engine("llama", tokenizer)
    expected, _ = reference(batched, tokenizer)
    (res,) = batched.generate_batch([PROMPT], max_new_tokens=3)
    assert res.deferred_modules and batched.background.wait_done(60)
    _same(stored(batched), expected)

    full = engine("llama", tokenizer, fallback="always", prefix_cache_bytes=1 << 20)
    expected, _ = reference(full, tokenizer)
    res = full.generate(PROMPT, max_new_tokens=3)
    assert res.path == "full" and set(res.deferred_modules) == set(MODULES)
    assert full.background.wait_done(60)
    _same(stored(full), expected)


def test_a_schema_that_encodes_modules_alone_never_reads_a_byproduct_entry(tokenizer):
    pc = engine("llama", tokenizer)
    pc.generate(PROMPT, max_new_tokens=1)
    assert pc.background.wait_done(60)
    plain_keys = set(engine("llama", tokenizer, byproduct=False).store_keys("s", list(MODULES)).values())
    assert not plain_keys & set(pc.store_keys("s", list(MODULES)).values())
    pc.add_schema(parse_schema(SCHEMA), replace=True)  # the same text, encoded on its own
    assert set(pc.plan(PROMPT, recovery="none").misses) >= set(MODULES)


def test_a_sliding_window_model_encodes_its_misses_on_their_own(tokenizer):
    pc = engine("mistral_window", tokenizer)
    plan = pc.plan(PROMPT, recovery="none")
    assert set(plan.deferred) >= set(MODULES) and not plan.byproducts
    pc.generate(PROMPT, max_new_tokens=1)
    assert pc.background.wait_done(60)
    ref = engine("mistral_window", tokenizer, byproduct=True)
    ref.model.load_state_dict(pc.model.state_dict())
    alone = ref.planner.encode([ref.schemas.compile("s", *ref.schemas.chat_of("s")).units["c"]])[0]
    assert torch.allclose(stored(pc)["c"].values, alone.values, atol=1e-5)


def test_byproduct_is_refused_where_there_is_nothing_to_keep_it_from(tmp_path: Path):
    from rag_promptcache.rag import Corpus

    docs = tmp_path / "d.txt"
    docs.write_text("Some text.")
    with pytest.raises(ValueError, match="--kv lazy"):
        Corpus.build([docs], tmp_path / "e", byproduct=True)
    with pytest.raises(ValueError, match="choose one"):
        Corpus.build([docs], tmp_path / "n", byproduct=True, kv="lazy", neighbours=2)
    assert not (tmp_path / "e").exists() and not (tmp_path / "n").exists()


def test_a_lazy_byproduct_corpus_keeps_what_its_questions_computed(tmp_path_factory, tmp_path: Path, monkeypatch):
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.layout import read_manifest
    from tests.test_lazy import QUESTIONS, TOPICS
    from tiny_llama import tiny_llama_and_records

    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")
    model, docs, emb = tiny_llama_and_records(tmp_path_factory, TOPICS, 24)
    c = Corpus.build([docs], tmp_path / "c", model=model, embedder=emb, chunk_tokens=64, progress=False,
                     redis_url="", kv="lazy", byproduct=True)
    try:
        assert read_manifest(tmp_path / "c").byproduct and c.info()["byproduct"]
        first = c.ask(QUESTIONS[0], k=3, max_new_tokens=4)
        assert first.served == "deferred" and first.missed_modules
        encoded: list[str] = []
        real = c.engine.background.encode
        c.engine.background.encode = lambda units: (encoded.extend(u.name for u in units), real(units))[1]
        c.store_deferred()
        assert c.engine.background.wait_done(60) and not c.engine.background.stats().num_failed
        assert not set(encoded) & set(first.missed_modules)  # kept from the prefill: no forward of their own
        again = c.ask(QUESTIONS[0], k=3, max_new_tokens=4)
        assert again.served == "store" and not again.missed_modules
        assert set(again.hit_modules) == set(first.module_ids)
    finally:
        c.close()
    with pytest.raises(ValueError, match="stays lazy"):
        Corpus.build([docs], tmp_path / "c", model=model, embedder=emb, redis_url="", kv="eager")


def test_eval_byproduct_answers_each_recovery_over_plain_and_borrowed_entries(tiny_corpus: Path, tmp_path: Path,
                                                                               capsys) -> None:
    import json

    from test_cli import assert_user_error, run

    qs = tmp_path / "q.jsonl"
    # the same question twice: each borrows the other's entries, which are its own prefill's, so by-product
    # `none` answers as full prefill does; a third question borrows where it can
    qs.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("What do cats do?", "What do cats do?",
                                                                        "Where do dogs sleep?")))
    code, out, err = run(capsys, "eval", qs, "--corpus", tiny_corpus, "--byproduct", "-k", "2", "--max-new-tokens",
                         "6", "--recovery", "none,last:1", "--json")
    assert code in (0, None), err
    got = json.loads(out)
    rows = {r["recovery"]: r for r in got["settings"]}
    assert list(rows) == ["none", "byproduct+none", "last:1", "byproduct+last:1"]
    assert [r["byproduct"] for r in got["settings"]] == [False, True, False, True]
    twins = [x["agrees"] for x in rows["byproduct+none"]["failures"] if x["question"] == "What do cats do?"]
    assert not twins  # each read its twin's entries: its own full prefill's
    assert got["recommended"] is None and got["no_recommendation"].startswith("no recommendation")  # no expected answers
    code, out, err = run(capsys, "eval", qs, "--corpus", tiny_corpus, "--byproduct", "-k", "2", "--max-new-tokens",
                         "4", "--recovery", "none")
    assert code in (0, None), err
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["entries,", "recovery", "full"]
    assert lines[2].startswith("plain, none") and lines[3].startswith("by-product, none")
    assert_user_error(run(capsys, "eval", qs, "--corpus", tiny_corpus, "--byproduct", "--apply"),
                      "--kv lazy --byproduct")
    assert_user_error(run(capsys, "eval", qs, "--corpus", tiny_corpus, "--byproduct", "--codec", "int4"),
                      "one at a time")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question": "What do cats do?"}) + "\n")
    assert_user_error(run(capsys, "eval", one, "--corpus", tiny_corpus, "--byproduct"), "two questions or more")


def test_ingest_refuses_byproduct_without_lazy_kv_before_loading_a_model(tmp_path: Path, capsys) -> None:
    from test_cli import assert_user_error, run

    docs = tmp_path / "d.txt"
    docs.write_text("Some text.")
    assert_user_error(run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--byproduct"), "ingest with --kv lazy")
    assert_user_error(run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--byproduct", "--kv", "lazy",
                          "--neighbours", "2"), "choose one")
    assert not (tmp_path / "c").exists()


def test_a_schema_is_refused_that_keeps_byproducts_and_names_neighbours(tokenizer):
    schema = dataclasses.replace(parse_schema(SCHEMA), byproduct=True, neighbours={"c": ("a",)})
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore())
    with pytest.raises(ValueError, match="choose one"):
        pc.add_schema(schema)
        pc.plan(PROMPT)
