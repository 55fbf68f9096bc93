"""The shape bench (benchmarks/shape.py) set up and run on its tiny config on the CPU: the
8B config's numbers, the module layout per context, a JSON with every field the tables read, and the
tables scripts/bench_tables.py makes of it. Timings are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import shape

ROOT = Path(__file__).resolve().parent.parent


def test_the_8b_config_is_llama_3_1_8b_and_the_layout_keeps_k_between_8_and_32():
    cfg = shape.shape_config("llama-3.1-8b")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (32, 4096, 14336)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 128256)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["rope_theta"] == 500000.0
    params = (cfg.vocab_size * cfg.hidden_size * 2 + cfg.num_hidden_layers * (
        cfg.hidden_size * cfg.hidden_size * 2 + 2 * cfg.hidden_size * 1024 + 3 * cfg.hidden_size * cfg.intermediate_size))
    assert 7.9e9 < params < 8.1e9  # about 16 GB in bf16
    assert [shape.layout(c) for c in (4096, 8192, 16384, 32768)] == [(8, 512), (16, 512), (32, 512), (32, 1024)]
    with pytest.raises(ValueError, match="valid: llama-3.1-8b, tiny"):
        shape.shape_config("llama-70b")


@pytest.mark.slow  # two minutes on two busy cores: the bench's own prompts, seven systems, four decoders
def test_the_tiny_shape_runs_every_system_and_its_json_makes_the_tables(tokenizer, tmp_path):
    model = shape.random_model("tiny", "cpu", torch.float32)
    out = tmp_path / "shape.json"
    run = shape.run(model, tokenizer, "tiny", [1024], repeats=1, decode_tokens=4, budget_s=600, json_path=out,
                    log=lambda _: None)
    saved = json.loads(out.read_text())
    assert saved["kind"] == "shape" and saved["shape"] == "tiny" and run["ttft"] == saved["ttft"]
    (row,) = saved["ttft"]
    assert (row["modules"], row["module_tokens"], row["context_tokens"]) == (2, 512, 1024)
    for key in ("full_s", "full_engine_s", "none_host_s", "none_gpu_s", "default_host_s", "default_gpu_s", "auto_s"):
        assert row[key] > 0, key
    assert row["auto_path"] in ("cached", "full") and row["recovery"]
    systems = [r["system"] for r in saved["decode"]]
    # on CPU every engine step is eager; transformers' compiled static cache runs on CUDA only
    assert systems == ["rag-promptcache (eager)"] * 3 + ["transformers"]
    assert sum(r["default"] for r in saved["decode"]) == 1
    tables = subprocess.run([sys.executable, "scripts/bench_tables.py", str(out)], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert "| 1024 | 2 x 512 |" in tables and "transformers" in tables and "tokens/s" in tables
