"""Link tokens (recovery `links:N`, model/links.py): the engine places learned tokens after each
module and computes them with the question; training reads the same layout under the block mask."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.recovery import Recovery, with_links
from rag_promptcache.engine.prompt.compiler import ROOT, Piece
from rag_promptcache.model import adapter as adapters
from rag_promptcache.model import links
from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.tune.layout import SCHEMA, Layouter, batch_masks
from tests.tiny_llama import save_tiny_llama

INSTRUCTIONS = "Answer from the documents below."
MODULES = ["[a.md]\nThe Kettle bridge opened in 1802 and has nine arches.\n\n",
           "[b.md]\nThe Ferro bridge opened in 1877; it has four arches and a toll house.\n\n",
           "[c.md]\nThe Lamb bridge opened in 1931.\n\n"]
QUESTION = "When did the Ferro bridge open?"
NAMES = [f"m{i}" for i in range(len(MODULES))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def tiny(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    links.install(model, links.fresh(model, 4, seed=1))
    return model, AutoTokenizer.from_pretrained(tiny_dir)


def _engine(model, tok, mode="shared_prefix", **kwargs) -> PromptCache:
    engine = PromptCache(model, tok, mode=mode, fallback="never", **kwargs)
    mods = {n: ast.Module(n, (ast.Text(t),)) for n, t in zip(NAMES, MODULES)}
    engine.add_schema(ast.Schema(SCHEMA, (ast.Role("system", (ast.Text(INSTRUCTIONS + "\n\n"), *mods.values())),),
                                 modules=mods, parents={n: None for n in NAMES}, union_of={}))
    return engine


def _prompt(question: str = QUESTION) -> ast.Prompt:
    return prompt_pml(SCHEMA, NAMES, [("user", question)])


@pytest.mark.parametrize("mode", ["shared_prefix", "isolated"])
def test_masked_forward_with_links_equals_the_engines_cached_plan(tiny, mode):
    model, tok = tiny
    ids = links.ids(model, 3)
    laid = Layouter(tok, mode, link_ids=ids).lay(INSTRUCTIONS, MODULES, QUESTION, "In 1877.")
    engine = _engine(model, tok, mode, recovery="none", prefix_cache_bytes=0)
    plan = engine.plan(_prompt(), recovery="links:3")
    assert [t for p in plan.pieces for t in p.token_ids] == laid.ids[:laid.answer_from]
    assert laid.num_links == 3 * len(MODULES) and plan.num_tokens == laid.answer_from
    got = engine.prefill(plan).logits
    batch, pos, mask = batch_masks([laid], [False])
    n = laid.answer_from
    with torch.no_grad():
        want = model(batch[:, :n], position_ids=pos[:, :n], attention_mask=mask[:, :, :n, :n]).logits[0, -1]
        plain = engine.prefill(engine.plan(_prompt(), recovery="none")).logits
    err = (got - want).abs().max().item()
    assert err < 2e-4, err
    assert (got - plain).abs().max().item() > 20 * err, "the links must change what the question reads"


def test_links_sit_after_each_module_and_move_what_follows():
    pieces = [Piece((1, 2), 0, ROOT), Piece((3, 4, 5), 2, "m0"), Piece((6,), 5, ROOT),
              Piece((7, 8), 6, "m1"), Piece((9, 10), 8)]
    out = with_links(pieces, (100, 101))
    assert [(p.token_ids, p.position, p.unit) for p in out] == [
        ((1, 2), 0, ROOT), ((3, 4, 5), 2, "m0"), ((100, 101), 5, None), ((6,), 7, ROOT),
        ((7, 8), 8, "m1"), ((100, 101), 10, None), ((9, 10), 12, None)]
    assert with_links(pieces, ()) == pieces


def test_recovery_spec():
    assert str(Recovery.parse("links:4")) == "links:4" and Recovery.parse("links:4").budget == 4
    with pytest.raises(ValueError, match="whole number of link tokens"):
        Recovery.parse("links:1.5")
    with pytest.raises(ValueError, match="links:N"):
        Recovery.parse("links:x")


def test_a_model_without_trained_links_refuses_them_by_name(tiny_dir, tiny):
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="links:2 needs an adapter trained with link tokens; this model has no"):
        _engine(base, tok).plan(_prompt(), recovery="links:2")
    with pytest.raises(ValueError, match="only 4 trained link tokens"):
        _engine(*tiny).plan(_prompt(), recovery="links:5")


def test_links_never_come_out_and_a_follow_up_reuses_them(tiny):
    model, tok = tiny
    engine = _engine(model, tok, recovery="links:2")
    first = engine.generate(_prompt(), max_new_tokens=6)
    again = engine.generate(_prompt(), max_new_tokens=6)
    assert not any(t >= links.of(model).first_id for t in first.token_ids)
    assert again.token_ids == first.token_ids
    assert again.num_prefix_tokens >= first.prompt_tokens - 1  # the links came from the prefix cache too
    plain = engine.generate(_prompt(), max_new_tokens=6, recovery="none")
    assert plain.prompt_tokens == first.prompt_tokens - 2 * len(MODULES)


def test_a_batch_with_links_answers_as_each_alone(tiny):
    model, tok = tiny
    engine = _engine(model, tok, recovery="links:3", prefix_cache_bytes=0)
    questions = [QUESTION, "Which bridge has nine arches?", "What does the Ferro bridge have?"]
    alone = [engine.generate(_prompt(q), max_new_tokens=8).token_ids for q in questions]
    batch = engine.generate_batch([_prompt(q) for q in questions], max_new_tokens=8)
    assert [r.token_ids for r in batch] == alone


def test_an_adapter_with_links_is_read_digested_and_installed(tiny_dir, tmp_path):
    from rag_promptcache.model.loading import load_model, model_fingerprint
    from tests.tiny_adapter import save_random_lora

    plain_dir = save_random_lora(tiny_dir, tmp_path / "plain")
    linked_dir = save_random_lora(tiny_dir, tmp_path / "linked")
    base, _ = load_model(tiny_dir, device="cpu", dtype="float32", adapter="none")
    links.save(links.fresh(base, 5, seed=3), linked_dir)
    plain, linked = adapters.read(plain_dir), adapters.read(linked_dir)
    assert (plain.num_links, linked.num_links) == (0, 5) and plain.digest != linked.digest
    model, tok = load_model(tiny_dir, device="cpu", dtype="float32", adapter=str(linked_dir))
    assert links.of(model) is not None and links.of(model).num_links == 5
    other, _ = load_model(tiny_dir, device="cpu", dtype="float32", adapter=str(plain_dir))
    assert links.of(other) is None and model_fingerprint(model) != model_fingerprint(other)
    engine = _engine(model, tok, recovery="links:5")
    assert engine.generate(_prompt(), max_new_tokens=4).finish_reason in ("length", "stop")
    (linked_dir / links.FILE).write_bytes(b"not a table")
    with pytest.raises(adapters.AdapterError, match="not a readable link table"):
        adapters.read(linked_dir)


def test_training_with_links_saves_and_resumes_them(tiny_dir, tmp_path):
    from rag_promptcache.tune.train import TuneConfig, train

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    first = model.get_input_embeddings().weight.shape[0]
    layouter = Layouter(tok, link_ids=range(first, first + 2))
    samples = [layouter.lay(INSTRUCTIONS, MODULES[: 1 + i % 3], QUESTION, f"In {1800 + i}.") for i in range(64)]
    assert all(s.plain().ids == Layouter(tok).lay(INSTRUCTIONS, MODULES[: 1 + i % 3], QUESTION, f"In {1800 + i}.").ids
               for i, s in enumerate(samples[:3]))

    def stream(start: int):
        i = start
        while True:
            yield i, samples[i % len(samples)]
            i += 1

    cfg = TuneConfig(rank=2, alpha=4, max_steps=2, tokens_per_batch=4096, links=2, autocast=False, warmup=1)
    _, state = train(model, stream, tmp_path / "run", cfg)
    saved = links.load(tmp_path / "run")
    assert state.step == 2 and saved is not None and saved.shape == (2, model.config.hidden_size)
    assert not torch.equal(saved, links.fresh(model, 2, seed=0)), "the link embeddings trained"
    meta = json.loads((tmp_path / "run" / "train.json").read_text())
    assert meta["config"]["links"] == 2
    again = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    _, resumed = train(again, stream, tmp_path / "run", TuneConfig(**{**meta["config"], "targets": tuple(cfg.targets),
                                                                        "max_steps": 3}))
    assert resumed.step == 3


def test_an_engine_refuses_links_as_its_default_where_the_model_has_none(tiny_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="links:4 needs an adapter trained with link tokens"):
        PromptCache(base, AutoTokenizer.from_pretrained(tiny_dir), recovery="links:4")


@pytest.mark.slow
def test_tune_learns_links_for_a_corpus(tiny_dir, tmp_path):
    from rag_promptcache.rag import Corpus
    from rag_promptcache.tune.corpus import tune_corpus
    from rag_promptcache.tune.train import TuneConfig
    from tests.test_cli_failures import cli

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(MODULES):
        (docs / f"d{i}.md").write_text(text.split("\n", 1)[1] * 3)
    built = cli("ingest", docs, "-c", tmp_path / "c", "--model", tiny_dir, timeout=300)
    assert built.returncode == 0, built.stderr
    corpus = Corpus.open(tmp_path / "c")
    try:
        report = tune_corpus(corpus, tmp_path / "tuned", TuneConfig(rank=2, alpha=4, max_steps=1, tokens_per_batch=2048,
                                                                    links=3), general=False, check=0)
    finally:
        corpus.close()
    assert report.steps == 1
    tuned = adapters.read(tmp_path / "tuned")
    assert tuned.num_links == 3 and tuned.recovery == "links:3"
