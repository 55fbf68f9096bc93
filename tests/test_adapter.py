"""Tuned adapters (model/adapter.py) on a tiny random Llama with a random LoRA: merged at load exactly as
peft runs it unmerged, covered by the fingerprint and the store keys, recorded in a corpus's manifest
and reloaded with it, refused with a clear error where missing or wrong, and shown by the CLI."""

from __future__ import annotations

import json
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from test_rag_corpus import FakeEmbedder, write_docs

from rag_promptcache.cli import main
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.model import adapter as adapters
from rag_promptcache.model.adapter import AdapterError
from rag_promptcache.model.loading import DEFAULT_MODEL, load_model, model_fingerprint
from rag_promptcache.rag.corpus import Corpus, CorpusWarning
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.prompts import result_stats
from rag_promptcache.store import MemoryStore
from tests.tiny_adapter import save_random_lora
from tests.tiny_llama import save_tiny_llama

SCHEMA = '<schema name="s"><module name="m">The zorblat is a purple fruit from the island of Quenti.</module></schema>'
PROMPT = '<prompt schema="s"><m/>What colour is the zorblat?</prompt>'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def lora(tiny, tmp_path_factory) -> Path:
    return save_random_lora(tiny, tmp_path_factory.mktemp("adapters") / "tuned")


@pytest.fixture
def fake_embedder(monkeypatch):
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: FakeEmbedder())


def test_merged_weights_compute_what_peft_computes_unmerged(tiny, lora):
    from peft import PeftModel

    tuned, tokenizer = load_model(tiny, device="cpu", dtype="float32", adapter=str(lora))
    base, _ = load_model(tiny, device="cpu", dtype="float32", adapter="none")
    reference = PeftModel.from_pretrained(load_model(tiny, device="cpu", dtype="float32", adapter="none")[0], str(lora))
    ids = torch.tensor([tokenizer.encode("The zorblat is a purple fruit.")])
    with torch.no_grad():
        merged, unmerged, plain = tuned(ids).logits, reference(ids).logits, base(ids).logits
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    assert (merged - plain).abs().max() > 1e-2  # the LoRA does change the model
    record = adapters.applied(tuned)
    assert record is not None and record.name == "tuned" and record.recovery == "none" and not record.shipped
    assert adapters.applied(base) is None and type(tuned) is type(base)  # peft's wrapper is gone after the merge
    assert model_fingerprint(tuned) != model_fingerprint(base)
    assert record.base_fingerprint == model_fingerprint(base)
    again, _ = load_model(tiny, device="cpu", dtype="float32", adapter=str(lora))
    with torch.no_grad():  # a merge elsewhere may round a weight differently: the corpus must still reopen
        w = again.model.layers[0].self_attn.q_proj.weight
        w[0, 0] = torch.nextafter(w[0, 0], w[0, 0] + 1)
    assert model_fingerprint(again) == model_fingerprint(tuned)
    bf16, _ = load_model(tiny, device="cpu", dtype="bfloat16", adapter=str(lora))  # merged in fp32, then cast
    assert bf16.dtype == torch.bfloat16 and adapters.applied(bf16).digest == record.digest
    assert model_fingerprint(bf16) not in (model_fingerprint(tuned), model_fingerprint(base))


def test_none_and_default_without_a_shipped_adapter_give_the_base_model(tiny):
    fingerprints = {model_fingerprint(load_model(tiny, device="cpu", dtype="float32", adapter=a)[0])
                    for a in (None, "none", "default")}
    assert len(fingerprints) == 1  # no adapter ships for a model directory


def test_default_finds_the_adapter_shipped_for_a_model_name(lora, tmp_path, monkeypatch):
    monkeypatch.setattr(adapters, "SHIPPED", tmp_path)
    assert adapters.find("default", DEFAULT_MODEL) is None
    shutil.copytree(lora, tmp_path / DEFAULT_MODEL)
    found = adapters.find("default", DEFAULT_MODEL.upper())
    assert found is not None and found.shipped and found.name == DEFAULT_MODEL
    assert adapters.find("default", "/models/" + DEFAULT_MODEL) is None  # a path is not a model name
    assert adapters.find("none", DEFAULT_MODEL) is None


def test_bad_adapters_are_refused_naming_what_is_wrong(tiny, lora, tmp_path):
    with pytest.raises(AdapterError, match="does not exist; pass an adapter directory"):
        load_model(tiny, device="cpu", adapter=str(tmp_path / "nope"))
    broken = shutil.copytree(lora, tmp_path / "broken")
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="lacks adapter_model.safetensors"):
        load_model(tiny, device="cpu", adapter=str(broken))
    newer = shutil.copytree(lora, tmp_path / "newer")
    tune = json.loads((newer / "tune.json").read_text())
    (newer / "tune.json").write_text(json.dumps({**tune, "format": 2}))
    with pytest.raises(AdapterError, match="adapter format 2, this version reads format 1"):
        load_model(tiny, device="cpu", adapter=str(newer))
    other = shutil.copytree(lora, tmp_path / "other")
    (other / "tune.json").write_text(json.dumps({**tune, "base_model": "another-model", "base_fingerprint": "0" * 16}))
    with pytest.raises(AdapterError, match="tuned for base model 'another-model'"):
        load_model(tiny, device="cpu", adapter=str(other))
    odd = shutil.copytree(lora, tmp_path / "odd")
    (odd / "tune.json").write_text(json.dumps({**tune, "recovery": "sometimes"}))
    with pytest.raises(ValueError, match="odd'?: tune.json's recovery: .*valid: none"):
        PromptCache(*load_model(tiny, device="cpu", adapter=str(odd)), store=MemoryStore())


def test_store_keys_and_default_recovery_follow_the_adapter(tiny, lora):
    # the cached plan always: no cost-model calibration per engine (seconds each under the coarse clock)
    base = PromptCache(*load_model(tiny, device="cpu", dtype="float32", adapter="none"), store=MemoryStore(),
                       fallback="never")
    tuned = PromptCache(*load_model(tiny, device="cpu", dtype="float32", adapter=str(lora)), store=MemoryStore(),
                        fallback="never")
    for engine in (base, tuned):
        engine.add_schema(SCHEMA)
    assert base.store_keys("s", ["m"]) != tuned.store_keys("s", ["m"])
    assert base.recovery == Recovery.parse(DEFAULT_RECOVERY) and tuned.recovery == Recovery.parse("none")
    result = tuned.generate(PROMPT, max_new_tokens=2)
    assert result.adapter == "tuned" and result_stats(result)["adapter"] == "tuned"
    assert base.generate(PROMPT, max_new_tokens=2).adapter is None
    tuned.recovery = "last:1"  # reaches the planner: a request naming none gets it
    assert tuned.recovery == tuned.planner.config.recovery == Recovery.parse("last:1")
    tuned.recovery = None
    assert tuned.recovery == Recovery.parse("none")
    named = PromptCache(tuned.model, tuned.tokenizer, store=MemoryStore(), recovery="last:2")
    assert named.recovery == Recovery.parse("last:2")


def test_a_corpus_reopens_with_its_adapter_and_refuses_another(tiny, lora, tmp_path, fake_embedder):
    path = tmp_path / "c"
    built = Corpus.build([write_docs(tmp_path / "docs")], path, model=tiny, adapter=str(lora), chunk_tokens=64,
                         progress=False, redis_url="")
    m = built.manifest
    assert (m.adapter, m.adapter_digest, m.adapter_path) == ("tuned", adapters.read(lora).digest, str(lora.resolve()))
    built.close()
    c = Corpus.open(path)
    assert c.engine.adapter_name == "tuned" and c.engine.fingerprint == m.fingerprint
    assert c.ask("Why do cats purr?", k=1, max_new_tokens=2).hit_modules  # modules reused, not re-encoded
    assert c.info()["adapter"] == "tuned" and c.engine.recovery == Recovery.parse("none")
    c.set_recovery("last:1")  # the manifest's recovery wins over the adapter's
    assert c.engine.recovery == Recovery.parse("last:1")
    c.set_recovery(None)
    assert c.engine.recovery == Recovery.parse("none")
    with pytest.raises(ValueError, match="applies to the model the corpus loads, not to a caller's engine"):
        Corpus.open(path, engine=c.engine, adapter="none")
    c.close()
    with pytest.raises(AdapterError, match="encoded with adapter 'tuned'.*the base model would not read"):
        Corpus.open(path, adapter="none")
    base = PromptCache(*load_model(tiny, device="cpu", dtype="float32", adapter="none"), name=tiny)
    with pytest.raises(ValueError, match="encoded with adapter 'tuned' .*this engine runs the base model"):
        Corpus.open(path, engine=base)
    other = save_random_lora(tiny, tmp_path / "other", seed=1)
    with pytest.raises(AdapterError, match="is not the one corpus .* was encoded with: adapter 'tuned'"):
        Corpus.open(path, adapter=str(other))
    moved = lora.rename(lora.with_name("moved"))
    try:
        c = Corpus.open(path)  # info and remove need no model
        with pytest.raises(AdapterError, match="adapter 'tuned' .* which is not available here"):
            c.prepare()
        c.close()
        assert Corpus.open(path, adapter=str(moved)).adapter_path == str(moved.resolve())  # a copy of it, named
    finally:
        moved.rename(lora)


def test_an_old_corpus_opens_with_the_base_model_and_says_how_to_re_encode(tiny, lora, tmp_path, monkeypatch, capsys,
                                                                           fake_embedder):
    path, docs = tmp_path / "old", write_docs(tmp_path / "docs")
    Corpus.build([docs], path, model=tiny, adapter="none", chunk_tokens=64, progress=False, redis_url="").close()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["adapter"] == "none" and manifest["adapter_digest"] is None
    for key in ("adapter", "adapter_digest", "adapter_path"):  # as written before adapters shipped
        del manifest[key]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Corpus.open(path).close()  # no adapter ships for this model: nothing to say
    monkeypatch.setattr(adapters, "shipped_dir", lambda name: lora)  # now one does
    with pytest.warns(CorpusWarning, match="encoded without the tuned adapter") as caught:
        c = Corpus.open(path)
    assert c.engine.adapter is None and c.engine.fingerprint == manifest["fingerprint"]  # as encoded
    c.close()
    command = str(caught[0].message).split("corpus: ", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["rag-promptcache", "ingest"] and str(docs / "cats.txt") in argv and f"{path}-tuned" in argv
    with pytest.raises(SystemExit) as exit_:
        main(argv[1:])  # the command it gives works, and encodes with the shipped adapter
    assert exit_.value.code == 0, capsys.readouterr().err
    assert json.loads((Path(f"{path}-tuned") / "manifest.json").read_text())["adapter"] == "tuned"


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_cli_adapter_flag_and_info(tiny, lora, tmp_path, capsys, fake_embedder):
    docs, path = write_docs(tmp_path / "docs"), tmp_path / "c"
    code, _, err = run(capsys, "ingest", docs, "--corpus", path, "--model", tiny, "--adapter", tmp_path / "nope")
    assert code == 1 and "does not exist; pass an adapter directory" in err and not path.exists()  # nothing half-made
    code, _, err = run(capsys, "ingest", docs, "--corpus", path, "--model", tiny, "--adapter", lora, "--chunk-tokens", 64)
    assert code == 0, err
    code, out, err = run(capsys, "info", "--corpus", path)
    assert code == 0 and f"tuned (digest {adapters.read(lora).digest}, merged into the model's weights)" in out
    assert "none (the adapter's;" in out  # the default recovery it brings
    code, out, _ = run(capsys, "info", "--corpus", path, "--json")
    assert json.loads(out)["adapter"] == "tuned"
    code, _, err = run(capsys, "ask", "Why do cats purr?", "--corpus", path, "--adapter", "none", "--max-new-tokens", 2)
    assert code == 1 and "encoded with adapter 'tuned'" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "ask", "Why do cats purr?", "--corpus", path, "--adapter", tmp_path / "nope")
    assert code == 1 and "does not exist" in err
    code, out, err = run(capsys, "ask", "Why do cats purr?", "--corpus", path, "--max-new-tokens", 2)
    assert code == 0 and "sources:\n" in out, err
    base = tmp_path / "base"
    assert run(capsys, "ingest", docs, "--corpus", base, "--model", tiny, "--adapter", "none", "--chunk-tokens", 64)[0] == 0
    assert "none (the base model)" in run(capsys, "info", "--corpus", base)[1]


@pytest.mark.slow
def test_v1_models_and_usage_say_which_adapter_ran(tiny, lora, tmp_path):
    import httpx

    from tests.test_server import start_server

    path = tmp_path / "corpus"
    Corpus.build([write_docs(tmp_path / "docs")], path, model=tiny, adapter=str(lora), chunk_tokens=64, progress=False,
                 redis_url="").close()
    proc, url = start_server(path, tmp_path / "server.log", "--k", "1")
    try:
        entry = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert entry["adapter"] == "tuned"
        body = {"model": "corpus", "messages": [{"role": "user", "content": "Why do cats purr?"}], "max_tokens": 2}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["usage"]["adapter"] == "tuned"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.smollm
def test_the_adapter_shipped_for_the_default_model_fits_its_weights():
    from rag_promptcache.engine.planning.encoder import DEFAULT_MODE

    directory = adapters.shipped_dir(DEFAULT_MODEL)
    if directory is None:
        pytest.skip(f"no adapter ships for {DEFAULT_MODEL} yet")
    shipped = adapters.read(directory)
    base, _ = load_model(DEFAULT_MODEL, device="cpu", dtype="float32", adapter="none")
    assert shipped.base_fingerprint == model_fingerprint(base) and shipped.mode == DEFAULT_MODE
    Recovery.parse(shipped.recovery)  # a recovery the engine knows


@pytest.mark.parametrize("command", ["ingest", "ask", "chat", "serve", "eval", "bench"])
def test_every_command_that_loads_the_model_takes_adapter(command, capsys):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "--adapter" in out and "none (the base model)" in " ".join(out.split())
