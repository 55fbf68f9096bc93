#!/usr/bin/env bash
# Train the default model's adapter on a lent GPU machine that reaches no network, in two calls
# (a call carries at most 64 MiB, the model file is 98 MB). Prepare here:
#   .gpu/   part_a (the GGUF's first 42,000,000 bytes), whl/ (transformers, peft, gguf wheels),
#           tok/ (the tokenizer files), passages.json.gz, probe_small.json.gz
#   .gpu2/  part_b (the rest), gguf.sha256, passages.json.gz, probe.json.gz
# (python -m rag_promptcache.tune.recipe --write-passages; python -m rag_promptcache.bench.tune_probe dump)
#   check:  scripts/tune_on_gpu.sh check   carry .gpu   : installs the wheels, runs the recipe on a tiny
#           random model with the real tokenizer for a few steps, keeps part_a for the next call
#   train:  scripts/tune_on_gpu.sh train S carry .gpu2  : joins the model, trains S seconds, probes
set -euo pipefail
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
OUT=${OUT:-out}
mkdir -p /tmp/m "$OUT"
case "$1" in
  check)
    cp .gpu/part_a /tmp/m/part_a
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
    python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(".gpu/tok")
cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained("/tmp/tiny")
tok.save_pretrained("/tmp/tiny")
PY
    python3 -m rag_promptcache.tune.recipe --out /tmp/tiny-adapter --model /tmp/tiny --device cuda --steps 4 \
      --tokens-per-batch 16384 --workers 4 --passages .gpu/passages.json.gz --probe .gpu/probe_small.json.gz \
      --probe-batch 8 2>&1 | tail -n 12
    ;;
  train)
    [ -f /tmp/m/part_a ] || { echo "no part_a: the machine is not the one the check ran on"; exit 3; }
    cat /tmp/m/part_a .gpu2/part_b > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$(cat .gpu2/gguf.sha256)  /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
    # bounded, so whatever happens the files below are copied before the call's own limit
    timeout "$(( ${2:-300} + 180 ))" python3 -m rag_promptcache.tune.recipe --out /tmp/adapter \
      --model /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --seconds "${2:-300}" \
      --tokens-per-batch "${TOKENS:-16384}" --workers 12 --passages .gpu2/passages.json.gz \
      --probe .gpu2/probe.json.gz --probe-batch 64 > "$OUT/log.txt" 2>&1 || echo "recipe exited $?"
    grep -v -i warn "$OUT/log.txt" | tail -n 20
    for f in adapter_config.json adapter_model.safetensors tune.json train.json probe_answers.json; do
      cp "/tmp/adapter/$f" "$OUT/" 2>/dev/null || echo "no $f"
    done
    ;;
esac
