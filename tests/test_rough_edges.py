"""A new user's rough edges, each held shut: `--json` errors as JSON, `serve -c`, `ingest
--instructions`, `--min-score` answering without generating, a cut-off answer marked, transformers'
cache keyword (no FutureWarning), a plain prompt's path. CLI tests run over the fake engine of
test_rag_corpus; the forward test over a tiny random Llama."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from test_cli import cut_off, fakes, run  # noqa: F401 - fakes is a fixture
from test_rag_corpus import write_docs

from rag_promptcache.rag.retrieval import NOT_FOUND


@pytest.fixture
def corpus(tmp_path: Path, fakes, capsys) -> Path:  # noqa: F811
    code, _, err = run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens", "32",
                       "--instructions", "Answer in one word.")
    assert code == 0, err
    return tmp_path / "c"


def test_json_errors_are_json(corpus: Path, capsys) -> None:
    code, out, err = run(capsys, "ask", "  ", "--corpus", corpus, "--json")
    assert code == 1 and err == ""
    assert json.loads(out) == {"error": {"message": "the question is empty", "type": "invalid_request_error"}}
    code, out, err = run(capsys, "ask", "  ", "--corpus", corpus)
    assert code == 1 and out == "" and err.strip() == "error: the question is empty"


def test_serve_takes_c_and_plain_help(tmp_path: Path, capsys) -> None:
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0 and "-c, --corpus" in out and "RANGE" not in out.upper().replace("--", "")
    assert "--log-level" in out and "--log-format" in out and "--min-score" in out
    code, _, err = run(capsys, "serve", "-c", tmp_path / "nope")
    assert code == 1 and "nope does not exist" in err, err
    code, _, err = run(capsys, "serve", "-c", tmp_path, "--port", "70000")
    assert code == 1 and "--port must be at least 0 and at most 65535" in err


def test_serve_admission_reaches_the_scheduler_and_bad_values_are_refused(corpus: Path, capsys, monkeypatch) -> None:
    import rag_promptcache.server as server
    from rag_promptcache.rag import Corpus

    code, out, _ = run(capsys, "serve", "--help")
    assert "--admission" in out and "RAG_PROMPTCACHE_ADMISSION" in out
    code, _, err = run(capsys, "serve", "-c", corpus, "--admission", "some")
    assert code == 1 and "--admission 'some': valid: all, one" in err, err
    code, _, err = run(capsys, "serve", "-c", corpus, "--admission", "one", "--prefill-chunk", "64")
    assert code == 1 and "excludes --prefill-chunk" in err, err
    served = []
    monkeypatch.setattr(server, "serve", lambda path, **options: served.append(options))
    assert run(capsys, "serve", "-c", corpus, "--admission", "one")[0] == 0 and served[0]["admission"] == "one"
    # and from build to the engine's scheduler (the fake engine has none: one that says what it was asked for)
    class Asked(Exception):
        pass

    def scheduler(self, **options):
        raise Asked(options)

    opened = Corpus.open(corpus)
    monkeypatch.setattr(type(opened.engine), "scheduler", scheduler, raising=False)
    with pytest.raises(Asked) as asked:
        server.build(opened, admission="one")
    assert asked.value.args[0] == {"max_batch": 8, "max_queue": 64, "prefill_chunk": None, "admission": "one"}


def test_ingest_instructions_from_a_file_and_info_shows_them(corpus: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = run(capsys, "info", "--corpus", corpus, "--json")
    assert json.loads(out)["instructions"] == "Answer in one word."
    (tmp_path / "sys.txt").write_text("Answer in French.\n")
    code, _, err = run(capsys, "ingest", tmp_path / "docs", "--corpus", tmp_path / "c2", "--instructions", "@" + str(tmp_path / "sys.txt"))
    assert code == 0, err
    code, out, _ = run(capsys, "info", "--corpus", tmp_path / "c2")
    assert "instructions  Answer in French." in out
    code, _, err = run(capsys, "ingest", tmp_path / "docs", "--corpus", corpus, "--instructions", "Other.")
    assert code == 1 and "encoding every module again" in err
    code, _, err = run(capsys, "ingest", tmp_path / "docs", "--corpus", tmp_path / "c3", "--instructions", "@missing.txt")
    assert code == 1 and "no such file" in err


def test_min_score_answers_not_found_without_generating(corpus: Path, fakes, capsys) -> None:  # noqa: F811
    fakes.stream = lambda *a, **k: pytest.fail("nothing scores 0.999: the model must not run")
    code, out, err = run(capsys, "ask", "Which way does the Nile flow?", "--corpus", corpus, "--min-score", "0.999")
    assert code == 0, err
    assert out.startswith(NOT_FOUND + "\n") and "sources: none" in out and "(none path)" in out
    code, out, _ = run(capsys, "ask", "Which way does the Nile flow?", "--corpus", corpus, "--min-score", "0.999", "--json")
    answer = json.loads(out)
    assert (answer["answer"], answer["path"], answer["sources"], answer["prompt_tokens"]) == (NOT_FOUND, "none", [], 0)
    code, _, err = run(capsys, "ask", "Nile?", "--corpus", corpus, "--min-score", "2")
    assert code == 1 and "between -1 and 1" in err


def test_a_cut_off_answer_is_marked(corpus: Path, fakes, capsys) -> None:  # noqa: F811
    fakes.stream = cut_off("The Nile flows")
    code, out, _ = run(capsys, "ask", "Which way does the Nile flow?", "--corpus", corpus, "--max-new-tokens", "2")
    assert code == 0 and "[cut off: the answer reached --max-new-tokens 2; raise it for the rest]" in out


def test_forward_passes_the_cache_keyword_transformers_asks_for(tmp_path: Path) -> None:
    from tiny_llama import save_tiny_llama

    from rag_promptcache.engine import PromptCache

    engine = PromptCache.from_pretrained(save_tiny_llama(tmp_path / "m"), dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        result = engine.generate("Hello there", max_new_tokens=3)  # a plain prompt: the model's own forward
    assert result.path == "full" and result.cached_tokens == 0  # no module imported: a plain full prefill


EXAMPLES = ("langchain_rag.py", "llamaindex_query_engine.py", "chatbot.py")


@pytest.mark.parametrize("script", EXAMPLES)
def test_an_example_refuses_a_corpus_it_did_not_build(script: str, corpus: Path, capsys, monkeypatch) -> None:
    import runpy
    import sys

    pytest.importorskip("langchain_rag_promptcache", reason="pip install -e integrations/langchain")
    pytest.importorskip("llama_index.llms.rag_promptcache", reason="pip install -e integrations/llamaindex")
    root = Path(__file__).resolve().parents[1]
    before = json.loads(run(capsys, "info", "--corpus", corpus, "--json")[1])["num_documents"]
    module = runpy.run_path(str(root / "examples" / script), run_name="example")
    monkeypatch.setattr(sys, "argv", [script, "--corpus", str(corpus), "--topics", "1"])
    with pytest.raises(SystemExit) as exc:
        module["main"]()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "is a corpus with documents of its own (cats.txt" in err, err
    assert json.loads(run(capsys, "info", "--corpus", corpus, "--json")[1])["num_documents"] == before

    parsers = []  # every option has help text

    def capture(self, *a, **k):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr("argparse.ArgumentParser.parse_args", capture)
    with pytest.raises(SystemExit):
        module["main"]()
    assert [a.dest for a in parsers[0]._actions if not a.help] == []


def test_the_demo_refuses_a_corpus_of_the_users(corpus: Path, capsys) -> None:
    code, _, err = run(capsys, "demo", "--corpus", corpus)
    assert code == 1 and "is a corpus with documents of its own" in err
