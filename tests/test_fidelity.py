"""Answer fidelity: the benchmark data, answer matching, question files, the module-level recoveries
(`last:N`, `attend:N`) and `rag-promptcache eval` end to end on SmolLM2 and a real corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_promptcache.bench.fidelity_data import generate
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.recovery import Recovery
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.fidelity import answer_contains, read_questions
from rag_promptcache.store import MemoryStore
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build


def test_data_is_deterministic_and_confusable():
    a, b = generate(), generate()
    assert a == b and len(a.documents) == len(a.questions) == 42
    assert len({d.metadata["source"] for d in a.documents}) == 42
    bridges = [d.page_content for d in a.documents if d.metadata["source"].startswith("bridge/")]
    assert all("It is well known in the region" in t and "stone pillars" in t for t in bridges)
    for d, q in zip(a.documents, a.questions):
        assert q.source == d.metadata["source"] and answer_contains(d.page_content, q.answer)
    assert {q.shape for q in a.questions} == {"fact", "prose"} and {q.fact for q in a.questions} >= {"year", "person"}


@pytest.mark.parametrize("text,expected,right", [
    ("It opened in 1737.", "1737", True), ("It opened in 17370.", "1737", False), ("about 1,737 m", "1737", True),
    ("designed by Anna Mbeki", "mbeki", True), ("Mbekis", "Mbeki", False), ("22 sailors", "2", False),
])
def test_answer_contains(text, expected, right):
    assert answer_contains(text, expected) is right


def test_read_questions(tmp_path: Path):
    good = tmp_path / "q.jsonl"
    good.write_text('{"question": "When?", "answer": 1737}\n\n{"question": "Who?"}\n')
    qs = read_questions(good)
    assert [(q.question, q.expected) for q in qs] == [("When?", ("1737",)), ("Who?", None)]
    for text, match in [("not json\n", "q.jsonl:1: not JSON"), ('{"answer": "x"}\n', "each line is"),
                        ('{"question": "a", "answer": ""}\n', "answer must be"), ("\n", "holds no questions")]:
        good.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_questions(good)


def test_module_recoveries_parse_and_recompute_whole_modules(tokenizer):
    assert [str(Recovery.parse(s)) for s in ("last:1", "attend:2", "attend:2@3")] == ["last:1", "attend:2", "attend:2@3"]
    for spec, match in [("last:1.5", "whole number of modules"), ("attend:-1", "whole number of modules"),
                        ("nearest:1", "valid: none, first_k, selective, last, attend")]:
        with pytest.raises(ValueError, match=match):
            Recovery.parse(spec)
    # the plans recovery makes, not the path the timed cost model picks for them (fallback="never")
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback="never")
    pc.add_schema(SCHEMA)
    base = pc.plan(PROMPT)
    sizes = {name: len(kv.token_ids) for name, kv in base.kvs.items()}  # the prompt imports b, a, c
    assert base.num_cached - pc.plan(PROMPT, recovery="last:1").num_cached == sizes["c"]
    assert base.num_cached - pc.plan(PROMPT, recovery="last:2").num_cached == sizes["a"] + sizes["c"]
    picked = base.num_cached - pc.plan(PROMPT, recovery="attend:1@1").num_cached
    assert picked in {sizes["a"], sizes["b"], sizes["c"]}
    for everything in ("last:3", "attend:3@1"):  # every module fresh: full prefill
        assert pc.compare(PROMPT, recovery=everything).max_abs_logit_diff <= 1e-3
    assert pc.compare(PROMPT, recovery="last:1").kl < pc.compare(PROMPT, recovery="none").kl


def test_tail_recomputes_the_nearest_modules_last_tokens(tokenizer):
    assert [str(Recovery.parse(s)) for s in ("tail:32", "tail:0")] == ["tail:32", "tail:0"]
    for spec in ("tail:2.5", "tail:-1"):
        with pytest.raises(ValueError, match="whole number of tokens"):
            Recovery.parse(spec)
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback="never")
    pc.add_schema(SCHEMA)
    base = pc.plan(PROMPT)
    c = base.kvs["c"].token_ids  # the prompt imports b, a, c: c is nearest the question
    plan = pc.plan(PROMPT, recovery="tail:3")
    assert base.num_cached - plan.num_cached == 3
    fresh = [p for p in plan.pieces if not p.cached]
    # the first fresh piece is c's last three tokens, at their places; the question follows
    assert tuple(fresh[0].token_ids) == tuple(c[-3:])
    cached_c = [p for p in plan.pieces if p.cached and p.unit == "c"]
    assert sum(len(p.token_ids) for p in cached_c) == len(c) - 3
    assert cached_c[-1].position + len(cached_c[-1].token_ids) == fresh[0].position
    # a tail as long as the module is last:1, to the logit
    whole = pc.compare(PROMPT, recovery=f"tail:{len(c)}")
    last = pc.compare(PROMPT, recovery="last:1")
    assert pc.plan(PROMPT, recovery=f"tail:{len(c) + 50}").num_cached == pc.plan(PROMPT, recovery="last:1").num_cached
    assert whole.max_abs_logit_diff == pytest.approx(last.max_abs_logit_diff, abs=1e-6)
    assert pc.plan(PROMPT, recovery="tail:0").num_cached == base.num_cached


def test_attend_refuses_a_model_without_q_proj(tokenizer):
    pc = PromptCache(build("gpt_neox_pct25", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore())
    pc.add_schema(SCHEMA)
    with pytest.raises(ValueError, match="q_proj.*use last:N"):
        pc.plan(PROMPT, recovery="attend:1@1")


@pytest.fixture(scope="module")
def real_parts(smollm):
    from rag_promptcache.rag import Embedder

    return smollm, Embedder()


def test_eval_command_end_to_end(real_parts, tmp_path: Path, capsys, monkeypatch):
    """Ingest six confusable documents with SmolLM2, then eval two questions (one with an answer)."""
    from rag_promptcache.cli import main

    (model, tokenizer), embedder = real_parts
    monkeypatch.setattr(corpus_mod, "_load_engine",
                        lambda name, store, mode, dtype=None, adapter=None: PromptCache(model, tokenizer, store=store, name=name,
                                                              **({} if mode is None else {"mode": mode})))
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: embedder)
    data = generate(per_kind=1, prose=0)
    docs = tmp_path / "docs"
    docs.mkdir()
    for d in data.documents:
        (docs / (d.metadata["source"].replace("/", "-") + ".txt")).write_text(d.page_content)
    questions = tmp_path / "q.jsonl"
    q0, q1 = data.questions[:2]
    questions.write_text(json.dumps({"question": q0.question, "answer": q0.answer}) + "\n"
                         + json.dumps({"question": q1.question}) + "\n")

    def cli(*args):
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        out = capsys.readouterr()
        return exc.value.code, out.out, out.err

    code, _, err = cli("ingest", docs, "--corpus", tmp_path / "c")
    assert code == 0, err
    code, out, err = cli("eval", questions, "--corpus", tmp_path / "c", "-k", "2", "--recovery", "none,last:2",
                         "--max-new-tokens", "12", "--json")
    assert code == 0, err
    report = json.loads(out)
    none, everything = report["settings"]
    assert (none["recovery"], everything["recovery"]) == ("none", "last:2")
    assert none["questions"] == 2 and none["with_answer"] == 1
    # k=2 and both modules recomputed: the same tokens as full prefill, the same greedy answers
    assert everything["agreement"] == 1.0 and everything["cached_correct"] == everything["full_correct"]
    # positive, or None where a TTFT was below the clock's resolution
    assert all(s["speedup"] is None or s["speedup"] > 0 for s in (everything, none))
    # the recommendation is the one rule's pick over these rows, and each failure shows both answers
    from rag_promptcache.rag.fidelity import fastest_passing

    rows = report["settings"]
    assert report["recommended"] == fastest_passing({r["recovery"]: (r["retained"], r["kept"]) for r in rows},
                                                    {r["recovery"]: r["speedup"] for r in rows})
    # last:2 here is full prefill's tokens: it fails only where full prefill is wrong too
    assert all(f["cached"] == f["full"] and f["full_right"] is False for f in everything["failures"])
    assert all({"question", "expected", "cached", "full"} <= set(f) for f in none["failures"])
    code, out, _ = cli("eval", questions, "--corpus", tmp_path / "c", "-k", "2", "--recovery", "none",
                       "--max-new-tokens", "4")
    table = out.split("\n\n")[0]  # the table and its legend, then the recommendation and the failing questions
    assert code == 0 and "kept" in table and "retained" in table and table.count("\n") == 3 and ("recommended: none" in out or "no recommendation" in out)
    code, _, err = cli("eval", questions, "--corpus", tmp_path / "c", "--recovery", "bogus:1")
    assert code == 1 and "valid: none, first_k" in err
