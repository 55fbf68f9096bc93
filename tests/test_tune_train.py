"""The tuning loop at tiny size: samples from real text, a LoRA trained under the block mask,
a checkpoint that resumes, and greedy probing that answers the same batched and alone."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rag_promptcache.tune.layout import Layouter
from rag_promptcache.tune.probe import greedy
from rag_promptcache.tune.recipe import module_text
from rag_promptcache.tune.samples import SampleMaker
from rag_promptcache.tune.texts import Passage, gather, held_out
from rag_promptcache.tune.train import TuneConfig, batches, train


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def maker():
    passages = [p for p in gather() if not held_out(p.source)]
    return SampleMaker(passages, "Answer from the documents.", k=(2, 4), seed=3)


def test_texts_and_samples_are_real_and_deterministic(maker):
    families = {p.family for p in maker.passages}
    assert "reference" in families and "docstring" in families  # Python's own text is on every machine
    a, b = maker(7), maker(7)
    assert a == b and a != maker(8)
    kinds = {maker(i).kind for i in range(40)}
    assert "cloze" in kinds
    s = maker(11)
    # the answer is in the passage marked relevant, which the prompt carries
    relevant = maker.passages[s.passages[s.relevant]]
    if s.kind == "cloze":
        assert s.answer in " ".join(relevant.text.split())
    else:
        assert any(v in s.answer for _, v in relevant.facts)
    with pytest.raises(ValueError, match="no passages"):
        SampleMaker([], "x")
    with pytest.raises(ValueError, match="valid: changelog, reference, docstring"):
        gather(("nope",))


def test_look_alikes_come_from_the_same_source():
    ps = [Passage("changelog", "pkg", "pkg/changelog.Debian", f"pkg ({i}) unstable; urgency=low\n  * Fix.\n -- A B <a@b>  Mon, 0{i} Jan 2024",
                  (("package", "pkg"), ("version", str(i)), ("name", "A B"), ("date", f"0{i} Jan 2024"))) for i in range(1, 6)]
    ps += [Passage("reference", "t", "reference/t.txt", "An unrelated paragraph about something else entirely and at length " * 3)]
    m = SampleMaker(ps, "x", k=(4, 4), seed=0)
    s = next(m(i) for i in range(20) if m(i).kind == "fact")
    assert sum(m.passages[i].source == "pkg" for i in s.passages) >= 3


def test_train_resumes_and_writes_a_peft_adapter(tiny, maker, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny)
    layouter = Layouter(tok)

    def stream(start):
        for i in itertools.count(start):
            s = maker(i)
            yield i, layouter.lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, s.answer)

    cfg = TuneConfig(rank=4, alpha=8, max_steps=2, tokens_per_batch=1500, save_every=1, lr=1e-2)
    peft_model, state = train(model, stream, tmp_path, cfg)
    assert state.step == 2 and state.samples > 0
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "checkpoint" / "state.json").exists()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n}
    assert lora and any(p.abs().sum() > 0 for p in lora.values()), "training moved the adapter"
    # a second run with a higher step limit resumes where the first stopped
    model2 = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    _, state2 = train(model2, stream, tmp_path, TuneConfig(rank=4, alpha=8, max_steps=3, tokens_per_batch=1500, lr=1e-2))
    assert state2.step == 3 and state2.samples >= state.samples
    meta = json.loads((tmp_path / "train.json").read_text())
    assert meta["step"] == 3 and len(meta["losses"]) == 3


def test_train_starts_from_another_adapter(tiny, maker, tmp_path):
    """A run can start from an adapter (the shipped one, float16): its weights, not a fresh LoRA's."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_adapter import save_random_lora

    start = save_random_lora(str(tiny), tmp_path / "start")
    weights = load_file(str(start / "adapter_model.safetensors"))
    save_file({k: v.half() for k, v in weights.items()}, str(start / "adapter_model.safetensors"))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    cfg = TuneConfig(rank=4, alpha=8, targets=targets, max_steps=0, init=str(start))
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    layouter = Layouter(AutoTokenizer.from_pretrained(tiny))

    def stream(start):
        for i in itertools.count(start):
            s = maker(i)
            yield i, layouter.lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, s.answer)

    peft_model, _ = train(model, stream, tmp_path / "out", cfg)
    got = {n: p for n, p in peft_model.named_parameters() if "lora_A" in n}
    assert got and all(p.abs().sum() > 0 for p in got.values())
    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    for k, v in weights.items():
        torch.testing.assert_close(saved[k], v.half().float(), atol=0, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot start from"):
        train(model, stream, tmp_path / "other", TuneConfig(rank=8, max_steps=0, init=str(start)))


def test_greedy_batched_equals_alone(tiny, maker):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny)
    layouter = Layouter(tok)
    prompts = []
    for i in range(4):
        s = maker(i)
        prompts.append(layouter.lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, ""))
    for full in (True, False):
        together = greedy(model, prompts, full=full, max_new_tokens=5, eos_ids=[tok.eos_token_id], batch=4)
        alone = [greedy(model, [p], full=full, max_new_tokens=5, eos_ids=[tok.eos_token_id])[0] for p in prompts]
        assert together == alone
    # full prefill's greedy answer is transformers' own generate
    p = prompts[0]
    ref = model.generate(torch.tensor([p.ids[:p.answer_from]]), max_new_tokens=5, do_sample=False,
                         eos_token_id=None)[0, p.answer_from:].tolist()
    got = greedy(model, [p], full=True, max_new_tokens=5, eos_ids=[-1])[0]
    assert got == ref
    assert len(set(map(tuple, together))) > 1, "the tiny model answers differently per prompt"


@pytest.mark.slow
def test_recipe_end_to_end_with_workers(tiny, tmp_path):
    """The one command, with the sample workers a GPU run uses: trains, writes the adapter and its record."""
    from rag_promptcache.tune.recipe import main

    rows = [{"instructions": "Answer from the documents.", "question": "Who uploaded it?", "answer": "Ana",
             "modules": ["[a.txt]\nAna uploaded pkg 1.0.\n\n", "[b.txt]\nBo uploaded pkg 2.0.\n\n"]}] * 2
    (tmp_path / "probe.json").write_text(json.dumps(rows))
    meta = main(["--out", str(tmp_path / "a"), "--model", str(tiny), "--device", "cpu", "--steps", "2",
                 "--workers", "2", "--tokens-per-batch", "1500", "--k-max", "3", "--probe", str(tmp_path / "probe.json")])
    assert meta["recovery"] == "none" and meta["mode"] == "shared_prefix" and meta["metrics"]["steps"] == 2
    answers = json.loads((tmp_path / "a" / "probe_answers.json").read_text())
    assert set(answers) == {"base/full", "base/none", "tuned/full", "tuned/none"} and len(answers["tuned/none"]) == 2
    assert meta["metrics"]["base_text_loss"] > 0 and meta["metrics"]["tuned_probe_seconds"] > 0
    assert json.loads((tmp_path / "a" / "tune.json").read_text())["base_fingerprint"] == meta["base_fingerprint"]
    assert (tmp_path / "a" / "adapter_config.json").exists()


def test_tuning_speaks_the_current_transformers_api(tiny, maker):
    """No deprecation notice reaches a `tune` user: the probe passes and reads the cache by the name the
    model takes (`cache` in newer transformers 5, which warns once on `past_key_values`), and peft's own
    question about gradient checkpointing is filtered, narrowly, where peft asks it."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from rag_promptcache.tune.train import attach

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny)
    s = maker(0)
    prompt = Layouter(tok).lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, "")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # it says each thing once per process: forget what it said
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            greedy(model, [prompt], full=False, max_new_tokens=3, eos_ids=[-1])
            attach(model, TuneConfig(rank=4, alpha=8))
    finally:
        hf_logger.removeHandler(handler)
    assert not [m for m in said if "deprecated" in m], said


@pytest.mark.slow
def test_recipe_trains_wrapper_tokens_with_the_lora(tiny, tmp_path):
    """`--wrap W`: W learned tokens before and after every module, trained with the LoRA; the adapter
    loads with them and the engine encodes every module wrapped."""
    from rag_promptcache.model import adapter as adapters
    from rag_promptcache.model import links
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.tune.recipe import main

    meta = main(["--out", str(tmp_path / "w"), "--model", str(tiny), "--device", "cpu", "--steps", "2", "--wrap", "2",
                 "--tokens-per-batch", "1500", "--k-max", "3", "--families", "reference"])
    assert meta["recipe"]["wrap"] == 2 and meta["metrics"]["steps"] == 2
    record = adapters.read(tmp_path / "w")
    assert (record.num_wrap, record.num_links) == (2, 0)
    model, _ = load_model(str(tiny), device="cpu", dtype="float32", adapter=str(tmp_path / "w"))
    fresh = links.fresh(model, 4, seed=meta["recipe"]["seed"])
    assert not torch.allclose(links.of(model).links.float(), fresh), "the wrappers trained"
    assert [len(ids) for ids in links.wrap_ids(model)] == [2, 2]


@pytest.mark.slow
def test_recipe_lays_modules_after_their_neighbours(tiny, tmp_path):
    """`--neighbours M`: every module of a training prompt laid out after its M nearest passages (by the
    corpus embedder, as `ingest --neighbours M` chooses), the lists written once and read back."""
    from dataclasses import asdict

    from rag_promptcache.tune import recipe
    from rag_promptcache.tune.texts import gather

    # a slice of the reference passages, so embedding them takes seconds (the training ones: not held out)
    some = [asdict(p) for p in gather(("reference",))[:120]]
    (tmp_path / "passages.json").write_text(json.dumps({"instructions": "Answer from the documents.", "passages": some}))
    args = ["--model", str(tiny), "--device", "cpu", "--steps", "2", "--tokens-per-batch", "3000", "--k-max", "3",
            "--passages", str(tmp_path / "passages.json"), "--neighbours", "2", "--neighbours-file", str(tmp_path / "near.json")]
    meta = recipe.main(["--out", str(tmp_path / "n"), *args])
    assert meta["recipe"]["neighbours"] == 2 and meta["metrics"]["steps"] == 2
    assert meta["recipe"]["max_len"] == 3 * 3072  # the neighbours' copies lengthen every sample
    near = json.loads((tmp_path / "near.json").read_text())
    assert near and all(len(n) == 2 and i not in n for i, n in enumerate(near))
    laid = recipe._lay(0)[1]  # the last run's sample maker and layouter, in this process
    assert laid.hidden is not None and any(laid.hidden) and laid.pos is not None
    (tmp_path / "near.json").write_text(json.dumps([[0, 1]]))  # lists for other passages: refused by name
    with pytest.raises(ValueError, match="near.json holds neighbour lists for other passages"):
        recipe.main(["--out", str(tmp_path / "m"), *args])
    # `--neighbours-present 2`: a prompt holds its asked passage's nearest (as retrieval returns them), and a
    # module reads its layout after its neighbours only where both are in the prompt
    args[args.index("--neighbours-file") + 1] = str(tmp_path / "wide.json")
    meta = recipe.main(["--out", str(tmp_path / "p"), *args, "--neighbours-present", "2", "--k-min", "3"])
    assert meta["recipe"]["neighbours_present"] == 2
    wide = json.loads((tmp_path / "wide.json").read_text())  # k-max 3: each passage's 3 nearest, for the prompts
    assert all(len(n) == 3 for n in wide) and [n[1:] for n in wide] == near
    maker, layouter, _, present = recipe._worker
    laid_any = 0
    for i in range(12):
        s = maker(i)
        target = s.passages[s.relevant]
        assert set(s.passages) - {target} == set(wide[target][1:])  # its two nearest
        mods = [recipe.module_text(maker.passages[j]) for j in s.passages]
        after = [[recipe.module_text(maker.passages[j]) for j in near[j]] for j in s.passages]
        keep = [a if set(near[j]) <= set(s.passages) else [] for a, j in zip(after, s.passages)]
        want = layouter.lay(s.instructions, mods, s.question, s.answer, neighbours=keep)
        got = recipe._lay(i)[1]
        assert (got.ids, got.hidden, got.pos) == (want.ids, want.hidden, want.pos)
        laid_any += any(got.hidden or ())
    assert present == 2 and laid_any  # some modules read after their neighbours
    with pytest.raises(SystemExit):
        recipe.main(["--out", str(tmp_path / "q"), *args, "--neighbours-present", "3"])  # more than it has


def test_samples_all_too_long_raise_rather_than_hang(tiny, maker):
    """A window of samples all longer than `max_len` (a layout after neighbours at many modules) says so:
    the batch stream would otherwise read forever and the time limit would never be checked."""
    layouter = Layouter(AutoTokenizer.from_pretrained(tiny))

    def stream():
        for i in itertools.count():
            s = maker(i)
            yield i, layouter.lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, s.answer)

    with pytest.raises(ValueError, match="longer than max_len = 16 tokens"):
        next(batches(stream(), TuneConfig(max_len=16)))
    group, after = next(batches(stream(), TuneConfig(tokens_per_batch=1 << 20)))
    assert group and after == 64


@pytest.mark.slow
def test_recipe_trains_wrapper_tokens_alone_on_a_frozen_lora(tiny, tmp_path, capsys):
    """`--wrap W --freeze-lora`: the wrappers train, the LoRA is the one `--init` gave, bit for bit."""
    from safetensors.torch import load_file

    from rag_promptcache.model import links
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.tune.recipe import main
    from rag_promptcache.tune.train import TARGETS, attach
    from tests.tiny_adapter import save_random_lora

    start = save_random_lora(str(tiny), tmp_path / "start", rank=16, targets=TARGETS)
    args = ["--model", str(tiny), "--device", "cpu", "--steps", "2", "--wrap", "2", "--tokens-per-batch", "1500",
            "--k-max", "3", "--families", "reference", "--init", str(start)]
    meta = main(["--out", str(tmp_path / "w"), *args, "--freeze-lora"])
    assert meta["recipe"]["freeze_lora"] and meta["metrics"]["steps"] == 2
    before, after = (load_file(str(d / "adapter_model.safetensors")) for d in (start, tmp_path / "w"))
    assert before.keys() == after.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v.float(), atol=0, rtol=0)
    model, _ = load_model(str(tiny), device="cpu", dtype="float32", adapter=str(tmp_path / "w"))
    fresh = links.fresh(model, 4, seed=meta["recipe"]["seed"])
    assert not torch.allclose(links.of(model).links.float(), fresh), "the wrappers trained"
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), *args[:4], "--freeze-lora"])
    assert "--freeze-lora trains the --links or --wrap tokens alone" in capsys.readouterr().err
    with pytest.raises(ValueError, match="freeze_lora trains the link or wrapper tokens alone"):
        attach(model, TuneConfig(freeze_lora=True))
