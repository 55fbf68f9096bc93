"""Our BERT encoder (model/bert.py) against transformers' BertModel, the reference: the same last hidden
states on the default embedder's directory and on a tiny random one, the same embedder vectors, a
directory it does not run falls back to transformers. That building the default embedder never imports
`transformers.modeling_utils` is checked in tests/test_embed_pooling.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rag_promptcache.model.bert import BertEncoder
from rag_promptcache.rag.embed import Embedder, resolve
from rag_promptcache.rag.mean_pooling import MeanPooled

TEXTS = ["What is lazy ingest?", "", "The quick brown fox jumps over the lazy dog. " * 12, "日本語のテキストです。",
         "fs.mkdir(path[, options], callback)", "a\nb\tc", "Café naïve résumé — émigré"]


@pytest.fixture(scope="module")
def default_dir() -> str:
    return resolve(None)[1]


def _reference(directory: str | Path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(directory)).eval()


def test_the_default_directory_gives_bert_models_states(default_dir: str) -> None:
    from transformers import AutoTokenizer

    ours, reference = BertEncoder.for_directory(default_dir), _reference(default_dir)
    assert ours is not None and not ours.training and not any(p.requires_grad for p in ours.parameters())
    names = {k for k in reference.state_dict() if not k.startswith("pooler.")}
    assert set(ours.state_dict()) == names  # transformers' parameter names, the pooler aside
    assert ours.config.hidden_size == 384 and ours.config.max_position_embeddings == 512 and ours.device.type == "cpu"
    batch = AutoTokenizer.from_pretrained(default_dir)(TEXTS, padding=True, truncation=True, max_length=256,
                                                       return_tensors="pt")
    assert not bool(batch["attention_mask"].all())  # padded
    with torch.inference_mode():
        got = ours(**batch)  # [B, T, H]
        want = reference(**batch).last_hidden_state
        assert got.shape == want.shape == (len(TEXTS), batch["input_ids"].shape[1], 384)
        assert (got - want).abs().max().item() < 1e-5
        one = {k: v[:1, :int(batch["attention_mask"][0].sum())] for k, v in batch.items()}  # unpadded
        assert (ours(**one) - reference(**one).last_hidden_state).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random BERT: hidden 32, 2 layers, 4 heads, every weight (LayerNorms too) drawn at random."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                        max_position_embeddings=40, type_vocab_size=3)
    model = BertModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny") / "bert"
    model.save_pretrained(path)
    return path


def test_a_tiny_random_bert_gives_bert_models_states(tiny_dir: Path) -> None:
    ours, reference = BertEncoder.for_directory(tiny_dir), _reference(tiny_dir)
    assert ours is not None and ours.config.hidden_size == 32 and ours.config.num_hidden_layers == 2
    torch.manual_seed(1)
    ids = torch.randint(0, 101, (4, 17))
    mask = torch.ones_like(ids)
    for row, length in enumerate((17, 9, 1, 13)):
        mask[row, length:] = 0
    types = torch.randint(0, 3, ids.shape)
    with torch.inference_mode():
        for kwargs in ({"attention_mask": mask, "token_type_ids": types}, {"attention_mask": mask},
                       {"attention_mask": torch.ones_like(ids)}, {}):
            got, want = ours(ids, **kwargs), reference(ids, **kwargs).last_hidden_state
            assert (got - want).abs().max().item() < 1e-5, kwargs.keys()


def _edited(source: Path, tmp_path: Path, change) -> Path:
    """`source` with its config.json changed; the other files linked, not copied."""
    out = tmp_path / "edited"
    shutil.copytree(source, out, copy_function=os.symlink)
    config = json.loads((source / "config.json").read_text())
    change(config)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("change", [
    lambda c: c.update(hidden_act="relu"), lambda c: c.update(hidden_act="gelu_new"),
    lambda c: c.update(position_embedding_type="relative_key"), lambda c: c.update(is_decoder=True),
    lambda c: c.update(model_type="roberta"), lambda c: c.update(torch_dtype="bfloat16"),
    lambda c: c.update(num_hidden_layers=1),  # a weight the config does not name
    lambda c: c.update(hidden_size=30),  # not a multiple of the heads
    lambda c: c.update(intermediate_size=40),  # not the weights' shape
], ids=["relu", "gelu_new", "relative_key", "decoder", "roberta", "bf16", "extra-weights", "heads", "shape"])
def test_a_directory_it_does_not_run_is_refused(tiny_dir: Path, tmp_path: Path, change) -> None:
    assert BertEncoder.for_directory(_edited(tiny_dir, tmp_path, lambda c: None)) is not None  # the unchanged copy runs
    shutil.rmtree(tmp_path / "edited")
    assert BertEncoder.for_directory(_edited(tiny_dir, tmp_path, change)) is None


def test_the_embedder_gives_auto_models_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = Embedder(batch_size=4)
    assert isinstance(ours.model, MeanPooled) and isinstance(ours.model.model, BertEncoder)
    assert ours.dim == 384 and ours.model.max_seq_length == 256
    got = ours.embed(TEXTS)
    monkeypatch.setattr(BertEncoder, "for_directory", classmethod(lambda cls, *args, **kwargs: None))
    theirs = Embedder(batch_size=4)
    assert not isinstance(theirs.model.model, BertEncoder)
    assert theirs.dim == ours.dim and theirs.model.max_seq_length == ours.model.max_seq_length
    np.testing.assert_allclose(got, theirs.embed(TEXTS), atol=1e-6, rtol=0)


@pytest.mark.parametrize("change", [lambda c: c.update(hidden_act="relu"),
                                    lambda c: c.update(position_embedding_type="relative_key")], ids=["relu", "relative_key"])
def test_a_directory_it_does_not_run_falls_back_to_transformers(default_dir: str, tmp_path: Path, change) -> None:
    from sentence_transformers import SentenceTransformer

    path = _edited(Path(default_dir), tmp_path, change)
    ours = Embedder(str(path))
    assert isinstance(ours.model, MeanPooled) and not isinstance(ours.model.model, BertEncoder)
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True,
                                                              show_progress_bar=False)
    np.testing.assert_allclose(ours.embed(TEXTS), want, atol=1e-5, rtol=0)

