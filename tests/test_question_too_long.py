"""A question longer than the model's context window can take is refused by name, never answered with
nothing: `fit` (the one place a question is fitted to the window), `Corpus.ask`, the `ask` command
(exit code 2, the JSON error with OpenAI's code) and `chat` (the chat goes on); an answer the model
ends before writing anything is marked. Over the fake engine of test_rag_corpus, whose tokenizer
makes one token of each short word; the server and the adapters: test_server_window.py and the
adapters' own tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import fakes, run  # noqa: F401 - fakes is a fixture
from test_rag_corpus import FakeEngine, build, write_docs

from rag_promptcache.engine.errors import ContextWindowExceeded, QuestionTooLong
from rag_promptcache.engine.result import Result, Stream
from rag_promptcache.rag import retrieval

def words(n: int) -> str:
    return " ".join(["word"] * n)


LONG = words(5000)  # 25,000 characters, 5,000 fake tokens


def count(text: str) -> int:
    return len(text.split())


def fit(question: str, max_new: int = 256, window: int = 200, sizes=(20, 10)):
    hits = [("m1", 0.9), ("m2", 0.5)][: len(sizes)]
    return retrieval.fit(hits, sizes, count, instructions=words(10), question=question, history=(), max_new=max_new,
                         window=window)


def test_fit_refuses_a_question_that_leaves_no_room_for_an_answer_naming_its_tokens_and_the_window():
    with pytest.raises(QuestionTooLong) as e:
        fit(words(5000))
    assert (e.value.num_question_tokens, e.value.window, e.value.max_new_fits) == (5000, 200, None)
    assert str(e.value).startswith("the question is 5000 tokens, too long for the model's 200-token context window")
    assert "shorten the question" in str(e.value)
    assert isinstance(e.value, ContextWindowExceeded) and isinstance(e.value, ValueError)  # callers that catch those still do
    # it fits the window, but leaves 200 - 10 - 32 - 20 - 130 = 8 tokens for the answer: refused, not answered in 8
    with pytest.raises(QuestionTooLong, match=r"leaves 8 for the answer, under the least an answer is asked with \(32\); "
                                              r"shorten the question to at most 106 tokens"):
        fit(words(130))


def test_fit_with_room_for_a_shorter_answer_names_the_answer_length_that_fits():
    with pytest.raises(ContextWindowExceeded) as e:
        fit(words(100))  # 200 - 10 - 32 - 20 - 100 = 38 tokens left: the answer must be shorter, the question may stay
    assert not isinstance(e.value, QuestionTooLong) and e.value.max_new_fits == 38
    assert "100 question" in str(e.value) and "lower max_new_tokens to at most 38" in str(e.value)
    assert fit(words(100), max_new=38) == [("m1", 0.9)]  # the lower-scoring hit dropped to make room
    with pytest.raises(QuestionTooLong):
        fit(words(100), max_new=50, window=170)  # 8 left: under the least asked with


@pytest.fixture
def small_window(tmp_path: Path):
    engine = FakeEngine()
    engine.context_window = 300
    return build(write_docs(tmp_path / "docs"), tmp_path / "c", engine)


def test_corpus_ask_refuses_a_twenty_thousand_character_question(small_window):
    for question in (LONG, words(230)):  # far past the window; within it, but leaving a few tokens for the answer
        with pytest.raises(QuestionTooLong, match=f"the question is {count(question)} tokens, too long for the model's "
                                                  "300-token context window"):
            small_window.ask(question)
    assert small_window.engine.prompts == []  # nothing was generated


def test_ask_prints_the_refusal_and_exits_2_also_as_json(tmp_path: Path, fakes, capsys):  # noqa: F811
    fakes.context_window = 300
    code, _, err = run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens", "32")
    assert code == 0, err
    code, out, err = run(capsys, "ask", LONG, "--corpus", tmp_path / "c")
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("error: the question is 5000 tokens, too long for the model's 300-token context window"), err
    assert "Traceback" not in err and "internal error" not in err
    code, out, err = run(capsys, "ask", LONG, "--corpus", tmp_path / "c", "--json")
    error = json.loads(out)["error"]
    assert code == 2 and err == ""
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "5000 tokens" in error["message"] and "300-token" in error["message"]
    # room for a shorter answer: the option to lower is named as the command spells it
    code, _, err = run(capsys, "ask", words(150), "--corpus", tmp_path / "c")
    assert code == 2 and "lower --max-new-tokens to at most" in err, err


def test_chat_says_why_and_goes_on(tmp_path: Path, fakes, capsys, monkeypatch):  # noqa: F811
    fakes.context_window = 300
    assert run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens", "32")[0] == 0
    lines = iter([LONG, "What do cats do?", "/quit"])
    monkeypatch.setattr("rag_promptcache.cli.commands._prompt", lambda text: next(lines))
    code, out, err = run(capsys, "chat", "--corpus", tmp_path / "c", "--max-new-tokens", "32")
    assert code == 0 and "error: the question is 5000 tokens, too long" in err, err
    assert out.count("bot> ") == 1 and "echo: " in out


def test_an_answer_the_model_ends_at_once_is_marked_not_left_blank(tmp_path: Path, fakes, capsys, monkeypatch):  # noqa: F811
    assert run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens", "32")[0] == 0

    def nothing(prompt, **sampling):
        def gen():
            return Result("", (2,), "eos", 0.01, 0.02, 100, 90, 10, (), (), ())
            yield  # a generator that yields nothing
        return Stream(gen())

    monkeypatch.setattr(fakes, "stream", nothing)
    for stream in ((), ("--stream",)):
        code, out, err = run(capsys, "ask", "What do cats do?", "--corpus", tmp_path / "c", *stream)
        assert code == 0, err
        assert "[no answer: the model ended it at once (finish_reason eos)" in out, out
