"""What one `ask` pays before its first token: a real process answers over a real corpus with the
default model and embedder, importing what the answer needs and none of the packages it does not
(checked on the modules the process imported, not by the clock: a timed bound would fail on a
loaded machine). The measured start-up is in docs/benchmarks.md (Start-up of `ask`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smollm

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "transformers", "faiss", "bm25s")  # the model, the dense and the lexical index
# what other commands, other embedders or the adapters use; `ask` imports none of them
NOT_NEEDED = ("sentence_transformers", "sklearn", "fastapi", "uvicorn", "starlette", "langchain_core", "llama_index",
              "ray", "matplotlib", "peft", "redis", "pandas", "rag_promptcache.server.app", "rag_promptcache.bench",
              "rag_promptcache.tune",
              # transformers' model code (model/llama.py and model/bert.py run the default model and embedder)
              "transformers.modeling_utils",
              # its package list, which naming a model-specific tokenizer class makes transformers build
              "transformers.models")
PROBE = ("import sys\nfrom rag_promptcache.cli import main\ncode = 0\ntry:\n    main(sys.argv[1:])\n"
         "except SystemExit as e:\n    code = e.code\n"
         "print('\\nIMPORTED', code, sorted(m for m in {names!r} if m in sys.modules), file=sys.stderr)")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    from rag_promptcache.rag import Corpus

    docs = tmp_path_factory.mktemp("docs")
    (docs / "trains.md").write_text("# Trains\n\nThe Blue Line train leaves the central station every 12 minutes. "
                                    "It stops at Harbor, Museum and Airport.")
    path = tmp_path_factory.mktemp("c") / "corpus"
    Corpus.build([docs], path, chunk_tokens=64, overlap=8, progress=False).close()  # the default model and embedder
    return path


def test_ask_imports_what_the_answer_needs_and_nothing_else(corpus_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAG_PROMPTCACHE_REDIS_URL"}
    done = subprocess.run([sys.executable, "-c", PROBE.format(names=NEEDED + NOT_NEEDED), "ask", "--corpus",
                           str(corpus_dir), "Where does the Blue Line stop?", "--json", "--max-new-tokens", "4"],
                          capture_output=True, text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, timeout=600)
    err, _, tail = done.stderr.rpartition("\nIMPORTED ")
    code, _, modules = tail.strip().partition(" ")
    assert code == "0", (done.stdout, done.stderr)
    assert json.loads(done.stdout.strip().splitlines()[-1])["sources"] == ["trains.md"]
    imported = json.loads(modules.replace("'", '"'))
    assert [m for m in imported if m in NOT_NEEDED] == [], err
    assert [m for m in NEEDED if m not in imported] == []  # the probe sees the real imports
