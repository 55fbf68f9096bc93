"""A corpus's codec: chosen at ingest (`--codec`, `Corpus.build(codec=)`), recorded in the manifest, used
by every tier the corpus opens, shown by `info` and `store info`; bad names list the valid ones; an
ingest is told the store's size per codec before it starts and the size when done; `eval --codec`
judges codecs against fp16 modules and recommends the smallest that keeps the answers.

Over the fake engine of tests/test_rag_corpus.py, and a tiny random Llama for `evaluate_codecs`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_cli import assert_user_error, run, use_fake_models
from test_rag_corpus import FakeEmbedder, FakeEngine, write_docs

from rag_promptcache.cli import commands
from rag_promptcache.engine.planning.costmodel import Costs, Fallback
from rag_promptcache.model.positions import KVGeometry
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag import ingest
from rag_promptcache.rag.codec_eval import CodecReport, recommend_codec
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import SettingReport
from rag_promptcache.rag.records import Manifest
from rag_promptcache.store import CODECS, DiskStore, MemoryStore, TieredStore
from rag_promptcache.store.codecs import CODEC_WARNINGS, bytes_per_token


class SizedEngine(FakeEngine):
    """The fake engine with the two facts an ingest's size estimate reads: KV geometry and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.geometry = KVGeometry(30, 3, 64, ("full_attention",) * 30, None)
        self.model = SimpleNamespace(dtype=torch.bfloat16)
        # a cost model whose forward costs a millisecond a token: an ingest's expected encoding time
        self.fallback = Fallback("auto", lambda: Costs(fixed_s=0.0, token_s=1e-3, pair_s=0.0, cached_token_s=0.0))


@pytest.fixture
def fakes(monkeypatch) -> SizedEngine:
    return use_fake_models(monkeypatch, SizedEngine())


def test_build_records_the_codec_and_every_tier_the_corpus_opens_uses_it(tmp_path: Path, fakes) -> None:
    c = Corpus.build([write_docs(tmp_path / "docs")], tmp_path / "c", chunk_tokens=32, codec="int8")
    assert c.manifest.codec == "int8" and c.info()["codec"] == "int8"
    store = c.open_store()
    assert isinstance(store, TieredStore) and [t.codec for t in store.tiers] == ["int8", "int8"]
    c.close()
    again = Corpus.open(tmp_path / "c")
    assert again.manifest.codec == "int8"
    again.close()
    with pytest.raises(ValueError, match="codec='int8', not 'int4'"):
        Corpus.build([tmp_path / "docs"], tmp_path / "c", codec="int4")


def test_a_bad_codec_name_lists_the_valid_ones(tmp_path: Path, fakes, capsys) -> None:
    with pytest.raises(ValueError, match="valid codecs: native, fp16"):
        Corpus.build([write_docs(tmp_path / "docs")], tmp_path / "c", codec="zip")
    assert not (tmp_path / "c").exists()
    assert_user_error(run(capsys, "ingest", tmp_path / "docs", "--corpus", tmp_path / "d", "--codec", "zip"),
                      "unknown codec 'zip'", "cachegen")
    assert not (tmp_path / "d").exists()


def test_manifests_from_before_codecs_read_as_fp16() -> None:
    m = Manifest("n", "m", "f", "isolated", "e", 4, 32, 4, 64, "flat", "", "0", 0.0, 0.0)
    data = json.loads(m.to_json())
    del data["codec"]
    assert Manifest.from_json(json.dumps(data), "old").codec == "fp16"


def test_ingest_tells_the_size_per_codec_before_and_the_store_after(tmp_path: Path, fakes, capsys, monkeypatch) -> None:
    monkeypatch.setattr(ingest, "LARGE_INGEST_TOKENS", 1)
    code, out, err = run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens",
                         "32", "--codec", "int4")
    assert code == 0, err
    assert "expected store growth per codec" in err and "int4" in err and "(this corpus)" in err
    assert all(c in err for c in CODECS)
    assert re.search(r"all of it now, about \d+s of encoding on this machine", err), err
    assert "store " in out and "(int4)" in out
    code, out, _ = run(capsys, "info", "--corpus", tmp_path / "c", "--json")
    assert json.loads(out)["codec"] == "int4"
    code, out, _ = run(capsys, "store", "info", "--corpus", tmp_path / "c")
    assert "int4" in out
    # an existing corpus keeps its codec
    assert_user_error(run(capsys, "ingest", tmp_path / "docs", "--corpus", tmp_path / "c", "--codec", "int8"),
                      "stores KV as int4")


def test_choosing_a_codec_not_shown_to_keep_answers_warns(tmp_path: Path, fakes, capsys) -> None:
    from rag_promptcache.rag.layout import CorpusWarning

    with pytest.warns(CorpusWarning, match="codec 'cachegen' is not shown to keep answers"):
        Corpus.build([write_docs(tmp_path / "docs")], tmp_path / "c", chunk_tokens=32, codec="cachegen").close()
    code, _, err = run(capsys, "ingest", tmp_path / "docs", "--corpus", tmp_path / "d", "--codec", "cachegen")
    assert code == 0 and "warning: codec 'cachegen' is not shown to keep answers" in err
    # measured (docs/stores.md): int8, k6v6 and k7v5 kept the answers; int4, k8v4, k5v5 and cachegen did not
    assert set(CODEC_WARNINGS) == {"int4", "cachegen", "k8v4", "k5v5"}


def test_cli_codec_names_match_the_store() -> None:
    from rag_promptcache.cli.app import SHOWN_CODECS, SHOWN_DTYPES
    from rag_promptcache.model import device

    assert SHOWN_CODECS == CODECS
    # --dtype is checked before torch is imported: the same names model.device.parse_dtype takes
    assert set(SHOWN_DTYPES) == {"auto", *device.DTYPES, *device._DTYPE_ALIASES}


def test_bytes_per_token_follows_the_formula_and_orders_the_codecs() -> None:
    geometry = (30, 3, 64)
    sizes = {c: bytes_per_token(c, geometry, torch.bfloat16) for c in CODECS}
    assert sizes["native"] == sizes["fp16"] == 2 * 30 * 3 * 64 * 2
    assert sizes["fp16"] > sizes["int8"] > sizes["int4"] > sizes["cachegen"]
    assert sizes["int8"] > 3 * sizes["cachegen"]


def _report(codec: str, bytes_: float, fp16_right: int, right: int, both: int) -> CodecReport:
    from rag_promptcache.rag.fidelity import QuestionResult

    results = tuple(QuestionResult(f"q{i}", ("a",), "", "", i < fp16_right, i < both or fp16_right <= i < fp16_right + right - both,
                                   True) for i in range(10))
    return CodecReport(codec, "none", bytes_, SettingReport(codec, 4, 10, 10, fp16_right, right, 1.0, 1.0, 1.0, 100.0, results))


def test_the_recommendation_is_the_smallest_codec_that_keeps_the_answers() -> None:
    reports = [_report("fp16", 23040, 10, 10, 10), _report("int8", 11970, 10, 10, 10), _report("int4", 6200, 10, 10, 8),
               _report("cachegen", 3900, 10, 6, 6)]
    assert [r.meets for r in reports] == [True, True, False, False]  # int4 keeps 8/10 < 0.90
    assert recommend_codec(reports).codec == "int8"
    assert recommend_codec(reports[2:]) is None


def test_no_codec_is_recommended_on_too_few_right_answers_of_fp16() -> None:
    """As `eval` for a recovery (rag.fidelity.too_few): fp16 right on 2 of 8 says nothing of a codec that
    keeps both (the run that recommended cachegen)."""
    from rag_promptcache.rag.fidelity import MIN_TO_RECOMMEND, too_few

    few = [_report("fp16", 23040, 2, 2, 2), _report("cachegen", 3900, 2, 2, 2)]
    assert few[1].meets and recommend_codec(few) is None
    assert too_few(few[0].report, "fp16 modules").startswith("fp16 modules answered only 2 of the 10 questions")
    enough = [_report("fp16", 23040, MIN_TO_RECOMMEND, MIN_TO_RECOMMEND, MIN_TO_RECOMMEND),
              _report("cachegen", 3900, MIN_TO_RECOMMEND, MIN_TO_RECOMMEND, MIN_TO_RECOMMEND)]
    assert recommend_codec(enough).codec == "cachegen" and too_few(enough[0].report) is None


def test_memory_and_disk_tiers_hold_the_codec(tmp_path: Path) -> None:
    from rag_promptcache.rag.corpus_store import open_store

    store = open_store(tmp_path / "s", 1 << 20, None, "n", "cachegen")
    assert [type(t) for t in store.tiers] == [MemoryStore, DiskStore] and {t.codec for t in store.tiers} == {"cachegen"}


@pytest.fixture
def tiny_corpus(tokenizer, tmp_path: Path, monkeypatch) -> Path:
    """A corpus over a tiny random Llama (real engine, real store) and the fake embedder; the corpus's
    loader hands out an engine over the same model, so `Corpus.open` and the CLI work offline."""
    from tests.tiny import build

    from rag_promptcache.engine import PromptCache

    model = build("llama", vocab_size=len(tokenizer))
    monkeypatch.setattr(corpus_mod, "_load_engine", lambda name, store, mode, dtype=None, adapter=None:
                        PromptCache(model, tokenizer, store=store, mode=mode or "shared_prefix", name="tiny"))
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: FakeEmbedder())
    c = Corpus.build([write_docs(tmp_path / "docs")], tmp_path / "c", model="tiny", chunk_tokens=32, codec="int8",
                     progress=False)
    c.close()
    return tmp_path / "c"


def test_evaluate_codecs_judges_against_fp16_modules(tiny_corpus: Path) -> None:
    from rag_promptcache.rag.codec_eval import evaluate_codecs
    from rag_promptcache.rag.fidelity import EvalQuestion

    c = Corpus.open(tiny_corpus)
    questions = [EvalQuestion("What do cats do?"), EvalQuestion("What is lava?", ("rock",))]
    reports = evaluate_codecs(c, questions, ["int8", "cachegen"], "none", k=2, max_new_tokens=4)
    c.close()
    by = {r.codec: r for r in reports}
    assert list(by) == ["fp16", "int8", "cachegen"]
    assert by["fp16"].report.agreement == 1.0 and by["fp16"].report.num_questions == 2
    assert by["fp16"].bytes_per_token > by["int8"].bytes_per_token > by["cachegen"].bytes_per_token > 0


def test_eval_codec_prints_each_codec_and_refuses_apply(tiny_corpus: Path, tmp_path: Path, capsys) -> None:
    qs = tmp_path / "q.jsonl"
    qs.write_text(json.dumps({"question": "What do cats do?", "answer": "purr"}) + "\n")
    code, out, err = run(capsys, "eval", qs, "--corpus", tiny_corpus, "--codec", "int4", "-k", "2",
                         "--max-new-tokens", "4", "--recovery", "none", "--json")
    assert code in (0, None), err
    got = json.loads(out)
    assert [r["codec"] for r in got["codecs"]] == ["fp16", "int4"] and got["recovery"] == "none"
    assert got["recommended"] is None and got["few_answers"] is True and got["no_recommendation"].startswith(
        "no recommendation: fp16 modules answered only")
    assert got["codecs"][1]["kept_counts"][1] == got["codecs"][0]["full_correct"]
    code, out, err = run(capsys, "eval", qs, "--corpus", tiny_corpus, "--codec", "int4", "-k", "2",
                         "--max-new-tokens", "4", "--recovery", "none")
    assert code in (0, None), err
    lines = out.splitlines()
    fp16_right = got["codecs"][0]["full_correct"]
    assert fp16_right == 0  # a tiny random model: its answers state no fact
    assert lines[0] == f"1 questions, k=2, recovery none, 1 with an expected answer; fp16 modules answer {fp16_right} of them right"
    assert lines[1].split() == ["codec", "bytes/token", "right", "kept", "95%", "interval", "retained", "agreement"]
    assert lines[2].split()[0] == "fp16" and lines[2].endswith("(reference)") and lines[3].split()[0] == "int4"
    assert f"warning: fp16 modules answered only {fp16_right} question(s) right, fewer than 30" in out
    assert ("no recommendation: fp16 modules answered only 0 of the 1 questions with an expected answer right, and a "
            "recommendation needs at least 10 right answers to rest on; add questions with expected answers.") in out
    # the tiny random model answers wrong: the question is listed once, fp16's answer once
    assert out.count("Q: What do cats do?") == 1 and len(re.findall(r"^    fp16: ", out, re.M)) == 1
    assert_user_error(run(capsys, "eval", qs, "--corpus", tiny_corpus, "--codec", "int4", "--apply"), "ingest into a new corpus")
    assert_user_error(run(capsys, "eval", qs, "--corpus", tiny_corpus, "--codec", "gzip"), "valid codecs")
