"""The CLI: exit codes and messages for bad input, and the commands over a fake engine and embedder.

Bad input must exit 1 with one clear line and leave nothing behind (no half-made corpus)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_rag_corpus import TOPICS, FakeEmbedder, FakeEngine, write_docs

from rag_promptcache.cli import main
from rag_promptcache.cli.store_cmds import parse_size
from rag_promptcache.engine.result import Result, Stream
from rag_promptcache.rag import Corpus
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.corpus_store import DEFAULT_CODEC
from rag_promptcache.rag.ingestor import Ingestor


def use_fake_models(monkeypatch, engine):
    """Corpora opened or built from here on load `engine` and a fake embedder instead of the models."""
    monkeypatch.setattr(corpus_mod, "_load_engine", lambda model, store, mode, dtype=None, adapter=None: engine)
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: FakeEmbedder())
    return engine


def cut_off(text: str):
    """A fake engine's `stream` whose every answer is `text`, cut off by the token budget."""
    def stream(prompt, **sampling):
        def gen():
            yield text
            return Result(text, (1, 2), "length", 0.01, 0.02, 100, 90, 10, (), (), ())
        return Stream(gen())
    return stream


@pytest.fixture
def fakes(monkeypatch):
    return use_fake_models(monkeypatch, FakeEngine())


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def assert_user_error(result: tuple[int, str, str], *needles: str) -> None:
    code, _, err = result
    assert code == 1, result
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") or "Error" in err, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture
def built(tmp_path: Path, fakes, capsys) -> Path:
    docs = write_docs(tmp_path / "docs")
    code, out, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")
    assert code == 0, err
    assert "created corpus" in out
    return tmp_path / "c"


def test_help_is_friendly(capsys) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(cmd in out for cmd in ("ingest", "ask", "chat", "info", "demo", "store"))


def test_ingest_ask_info_remove(built: Path, tmp_path: Path, capsys) -> None:
    code, out, err = run(capsys, "ask", "--corpus", built, "which river is in Africa?", "-k", "2", "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert {"answer", "module_ids", "sources", "ttft_s", "cached_tokens", "computed_tokens", "missed_modules"} <= set(answer)
    assert len(answer["module_ids"]) == 2 and answer["sources"][0] == "rivers.md"
    code, out, _ = run(capsys, "ask", "--corpus", built, "volcano lava?", "--stream")
    assert code == 0 and out.startswith("echo: ") and "sources:\n  sub/volcano.txt (" in out
    code, out, _ = run(capsys, "info", "--corpus", built)
    assert code == 0 and re.search(r"documents\s+3\n", out) and "fake-model" in out
    code, out, _ = run(capsys, "ingest", tmp_path / "docs", "--corpus", built)
    assert code == 0 and "3 unchanged" in out
    code, out, _ = run(capsys, "remove", tmp_path / "docs" / "cats.txt", "--corpus", built)
    assert code == 0 and "removed" in out
    assert json.loads(run(capsys, "info", "--corpus", built, "--json")[1])["num_documents"] == 2


def test_chat(built: Path, capsys, monkeypatch) -> None:
    lines = iter(["tell me about cats", "/sources", "/nope", "and rivers?", "/quit"])
    monkeypatch.setattr("rag_promptcache.cli.commands._prompt", lambda prompt="": next(lines))
    code, out, _ = run(capsys, "chat", "--corpus", built, "-k", "1")
    assert code == 0 and out.count("bot> echo: m") == 2 and "\n  cats.txt (" in out and "commands:" in out


def test_chat_sources_after_a_stopped_answer_are_that_answers(built: Path, fakes, capsys, monkeypatch) -> None:
    """Ctrl-C mid-answer, then /sources: the stopped answer's sources, not the answer before it."""
    lines = iter(["tell me about cats", "which river flows north into the Mediterranean?", "/sources", "/quit"])
    monkeypatch.setattr("rag_promptcache.cli.commands._prompt", lambda prompt="": next(lines))
    answer = fakes.stream

    def stream(prompt: str, **sampling) -> Stream:
        pieces = answer(prompt, **sampling)
        if "river" not in prompt:
            return pieces

        def stopped():
            yield next(pieces)
            raise KeyboardInterrupt  # what SIGINT raises in the main thread mid-answer

        return Stream(stopped())

    monkeypatch.setattr(fakes, "stream", stream)
    code, out, _ = run(capsys, "chat", "--corpus", built, "-k", "1")
    assert code == 0 and "[stopped; the chat goes on]" in out
    listed = out.split("[stopped; the chat goes on]", 1)[1]
    assert "  rivers.md › Rivers (" in listed and "cats.txt" not in listed


def test_ingest_from_a_copied_folder_says_it_replaced(built: Path, tmp_path: Path, capsys) -> None:
    import shutil

    copy = shutil.copytree(tmp_path / "docs", tmp_path / "copy")
    code, out, err = run(capsys, "ingest", copy, "--corpus", built)
    assert code == 0, err
    assert "replaced 3 document(s) of the same name ingested from another place" in out and "3 documents" in out


def test_missing_path(tmp_path: Path, capsys) -> None:
    assert_user_error(run(capsys, "ingest", tmp_path / "nope", "--corpus", tmp_path / "c"), "no such file or directory")
    assert not (tmp_path / "c").exists()


def test_empty_directory(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert_user_error(run(capsys, "ingest", tmp_path / "empty", "--corpus", tmp_path / "c"), "empty directory")
    assert not (tmp_path / "c").exists()


def test_empty_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "e.txt").write_text("")
    result = run(capsys, "ingest", tmp_path / "e.txt", "--corpus", tmp_path / "c")
    assert_user_error(result, "nothing to ingest", "empty file")
    assert "warning: skipping" in result[2]
    assert not (tmp_path / "c").exists()


def test_non_utf8_file_is_read_in_the_encoding_detected(tmp_path: Path, fakes, capsys) -> None:
    (tmp_path / "latin1.txt").write_bytes("Le café est fermé le lundi; la crème brûlée coûte sept euros à Genève.".encode("latin-1"))
    code, out, err = run(capsys, "ingest", tmp_path / "latin1.txt", "--corpus", tmp_path / "c")
    assert code == 0, err
    assert "latin1.txt: not UTF-8; read as" in err and "1 documents" in out


def test_non_utf8_file_among_good_ones_is_skipped(tmp_path: Path, fakes, capsys) -> None:
    docs = write_docs(tmp_path / "docs")
    (docs / "bad.txt").write_bytes(b"\xff\xfe bad bytes \x80")
    (docs / "image.png").write_bytes(b"\x89PNG\r\n")
    code, out, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32")
    assert code == 0 and err.count("warning: skipping") == 1 and "bad.txt" in err and "3 documents" in out
    assert "skipped 2 file(s) or record(s): " in out and "1 unsupported type (.png 1)" in out  # counted, not warned


def test_50mb_file_is_refused_without_reading_it_into_memory(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(corpus_mod, "_load_engine", lambda *a: pytest.fail("the model must not load"))
    line = b"A log line that repeats, with some words in it to look like text.\n"
    with (tmp_path / "big.txt").open("wb") as f:
        for _ in range(50 * 2**20 // (len(line) * 1024) + 1):
            f.write(line * 1024)
    assert (tmp_path / "big.txt").stat().st_size >= 50 * 2**20
    assert_user_error(run(capsys, "ingest", tmp_path / "big.txt", "--corpus", tmp_path / "c"), "exceeds the ingest budget", "--max-ingest-tokens")
    assert not (tmp_path / "c").exists()


def test_not_a_corpus(tmp_path: Path, capsys) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hello")
    assert_user_error(run(capsys, "ask", "--corpus", tmp_path / "d", "why?"), "is not a corpus")
    assert_user_error(run(capsys, "info", "--corpus", tmp_path / "nope"), "does not exist")
    assert_user_error(run(capsys, "ingest", tmp_path / "d" / "x.txt", "--corpus", tmp_path / "d"), "exists and is not a corpus")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["x.txt"]  # nothing written into it


def test_question_on_an_empty_corpus(built: Path, tmp_path: Path, capsys) -> None:
    c = Corpus.open(built, FakeEngine(), embedder=FakeEmbedder())
    for source in [d.source for d in c.table.documents()]:
        c.remove(source)
    c.close()
    assert_user_error(run(capsys, "ask", "--corpus", built, "anything?"), "is empty")


@pytest.mark.parametrize("k", ["0", "-3"])
def test_bad_k(built: Path, capsys, k: str) -> None:
    assert_user_error(run(capsys, "ask", "--corpus", built, "cats?", "-k", k), "-k must be at least 1")


def test_usage_errors_exit_1(capsys) -> None:
    code, _, err = run(capsys, "ask")
    assert code == 1 and "Missing" in err
    code, _, _ = run(capsys, "ask", "--corpus", "x", "q", "-k", "two")
    assert code == 1


def test_settings_of_an_existing_corpus_cannot_change(built: Path, tmp_path: Path, capsys) -> None:
    assert_user_error(run(capsys, "ingest", tmp_path / "docs", "--corpus", built, "--chunk-tokens", "64"), "chunk_tokens=32, not 64")
    assert_user_error(run(capsys, "ingest", tmp_path / "docs", "--corpus", built, "--model", "other"), "'fake-model', not 'other'")


def test_interrupted_ingest_exits_130_and_resumes(tmp_path: Path, fakes, capsys, monkeypatch) -> None:
    docs = write_docs(tmp_path / "docs", {**TOPICS, **{f"x{i}.txt": f"Extra document number {i}. " * 40 for i in range(4)}})
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 4)
    real_flush = Ingestor.flush
    calls = []

    def flaky_flush(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_flush(self, *args)

    monkeypatch.setattr(Ingestor, "flush", flaky_flush)
    code, _, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32")
    assert code == 130 and "resume" in err
    monkeypatch.setattr(Ingestor, "flush", real_flush)
    code, out, _ = run(capsys, "ingest", docs, "--corpus", tmp_path / "c")
    assert code == 0 and "updated corpus" in out
    assert json.loads(run(capsys, "info", "--corpus", tmp_path / "c", "--json")[1])["num_incomplete"] == 0


def test_internal_error_exits_2(built: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(Corpus, "ask", lambda *a, **k: 1 / 0)
    code, _, err = run(capsys, "ask", "--corpus", built, "cats?")
    assert code == 2 and "internal error: ZeroDivisionError" in err and "Traceback" not in err


def test_parse_size() -> None:
    assert parse_size("1024") == 1024 and parse_size("2MB") == 2_000_000 and parse_size("1GiB") == 2**30
    with pytest.raises(ValueError, match="bad size"):
        parse_size("lots")


def test_demo_builds_then_reuses(tmp_path: Path, fakes, capsys) -> None:
    code, out, err = run(capsys, "demo", "--corpus", tmp_path / "demo", "--max-new-tokens", "4")
    assert code == 0, err
    assert "building the demo corpus" in out and out.count("vs the engine's full prefill") == 3 and "pydoc_data.topics/" in out
    code, out, _ = run(capsys, "demo", "--corpus", tmp_path / "demo")
    assert code == 0 and "reusing the demo corpus" in out and "ingested" not in out


def test_store_commands(built: Path, capsys) -> None:
    code, out, _ = run(capsys, "store", "info", "--corpus", built, "--json")
    assert code == 0 and json.loads(out)["kind"] == "DiskStore" and json.loads(out)["codec"] == DEFAULT_CODEC == "k6v6"
    code, out, _ = run(capsys, "store", "info", "--corpus", built)
    assert code == 0 and out.splitlines()[1].split() == ["entries", "0", "(0", "tokens)"] and f"codec    {DEFAULT_CODEC}" in out
    code, out, _ = run(capsys, "store", "verify", "--corpus", built)
    assert code == 0 and out.startswith("checked")
    code, out, _ = run(capsys, "store", "evict", "--corpus", built, "--to", "0")
    assert code == 0 and out.startswith("evicted")
    assert_user_error(run(capsys, "store", "info", "--corpus", built.parent), "is not a corpus")


def test_a_page_its_site_marks_as_a_copy_is_skipped_and_dropped_where_ingested_before(tmp_path: Path, fakes, capsys) -> None:
    # mdBook's print.html holds the whole book again: named by itself it is read, in a walk it is a copy, and
    # the walk drops it from a corpus that holds it, so the corpus ends as a fresh ingest of the folder would
    docs = write_docs(tmp_path / "docs")
    (docs / "print.html").write_text('<html><head><meta name="robots" content="noindex"></head><body><p>'
                                     + (docs / "cats.txt").read_text() + "</p></body></html>")
    code, out, err = run(capsys, "ingest", docs / "print.html", "--corpus", tmp_path / "c")
    assert code == 0 and "1 documents" in out, err
    code, out, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c")
    assert code == 0 and "warning" not in err, err
    assert "1 removed" in out and "skipped 1 file(s) or record(s): 1 noindex page" in out
    assert json.loads(run(capsys, "info", "--corpus", tmp_path / "c", "--json")[1])["num_documents"] == 3
