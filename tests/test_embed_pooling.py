"""The default embedder runs on transformers alone (rag/mean_pooling.py): its vectors are
sentence-transformers' own for the same directory (the reference), a directory of another shape still
runs through sentence-transformers, and loading it imports neither sentence-transformers nor the
scikit-learn it pulls in (checked on the modules a real process imported, not by the clock)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rag_promptcache.rag.embed import Embedder, resolve
from rag_promptcache.rag.mean_pooling import MeanPooled, max_seq_length

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["What is lazy ingest?", "  spaces around  ", "", "word " * 600, "日本語のテキストです。東京は首都。",
         "Café naïve résumé — émigré", "fs.mkdir(path[, options], callback)", "a\nb\tc", "x" * 3000,
         "The quick brown fox jumps over the lazy dog. " * 20] + [f"sentence {i} about topic {i % 7}" for i in range(70)]


@pytest.fixture(scope="module")
def default_dir() -> str:
    return resolve(None)[1]


def test_the_default_embedder_gives_sentence_transformers_vectors(default_dir: str) -> None:
    from sentence_transformers import SentenceTransformer

    ours = Embedder(batch_size=16)  # several batches, each padded to its own longest text
    assert isinstance(ours.model, MeanPooled) and ours.dim == 384 and ours.model.max_seq_length == 256
    reference = SentenceTransformer(default_dir, device="cpu")
    want = reference.encode(TEXTS, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    got = ours.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert ours.model.max_seq_length == reference.max_seq_length  # the server's /v1/embeddings limit is unchanged


def _variant(default_dir: str, tmp_path: Path, edit) -> Path:
    """The default directory's configuration files (not its weights) with one change."""
    out = tmp_path / "variant"
    out.mkdir()
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        shutil.copy(Path(default_dir) / name, out / name)
    (out / "1_Pooling").mkdir()
    shutil.copy(Path(default_dir) / "1_Pooling" / "config.json", out / "1_Pooling" / "config.json")
    edit(out)
    return out


def _json_edit(name: str, change):
    def edit(root: Path) -> None:
        data = json.loads((root / name).read_text())
        change(data)
        (root / name).write_text(json.dumps(data))
    return edit


@pytest.mark.parametrize("edit", [
    _json_edit("1_Pooling/config.json", lambda d: d.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)),
    _json_edit("1_Pooling/config.json", lambda d: d.update(pooling_mode_max_tokens=True)),
    _json_edit("modules.json", lambda d: d.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                                                      "type": "sentence_transformers.models.Dense"})),
    _json_edit("sentence_bert_config.json", lambda d: d.update(do_lower_case=True)),
    _json_edit("sentence_bert_config.json", lambda d: d.update(model_args={"trust_remote_code": True})),
    _json_edit("config_sentence_transformers.json", lambda d: d.update(prompts={"query": "query: "})),
    lambda root: (root / "modules.json").unlink(),
], ids=["cls", "mean+max", "dense", "lower-case", "model-args", "prompts", "no-modules"])
def test_a_directory_of_another_shape_runs_through_sentence_transformers(default_dir: str, tmp_path: Path, edit) -> None:
    assert max_seq_length(_variant(default_dir, tmp_path, lambda root: None)) == 256  # the unchanged copy qualifies
    shutil.rmtree(tmp_path / "variant")
    assert max_seq_length(_variant(default_dir, tmp_path, edit)) is None


PROBE = ("import sys\nfrom rag_promptcache.rag.embed import Embedder\ne = Embedder()\nv = e.embed(['a question'])\n"
         "print(v.shape, type(e.model.model).__name__, sorted(m for m in ('sentence_transformers', 'sklearn', "
         "'scipy.stats', 'transformers.modeling_utils', 'transformers.models') if m in sys.modules))")


def test_the_default_embedder_loads_without_sentence_transformers_or_transformers_model_loading() -> None:
    """Its BERT is ours (model/bert.py), so neither sentence-transformers nor transformers' model code loads,
    and its tokenizer is read from tokenizer.json, so transformers does not list its model packages either."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 384) BertEncoder []"


def test_the_default_embedders_tokenizer_gives_the_inputs_autotokenizer_gives(default_dir: str) -> None:
    """Read from tokenizer.json (`loading.tokenizer_from`), it is AutoTokenizer's BertTokenizer to the token:
    the same ids, the same inputs (token_type_ids included), the same truncation and padding."""
    from transformers import AutoTokenizer

    ours = Embedder().model.tokenizer
    reference = AutoTokenizer.from_pretrained(default_dir, model_max_length=256)
    assert type(reference).__name__ == "BertTokenizer" and ours.model_input_names == reference.model_input_names
    for start in range(0, len(TEXTS), 16):
        got, want = (t(TEXTS[start:start + 16], padding=True, truncation="longest_first", return_tensors="np")
                     for t in (ours, reference))
        assert set(got) == set(want) == {"input_ids", "token_type_ids", "attention_mask"}
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
