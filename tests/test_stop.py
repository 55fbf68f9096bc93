"""A bare stop string is one stop string everywhere (engine, Sampling, Corpus.ask), never its characters.

SmolLM2's answers contain the letters of "zzzz-never" (e, n, r, v, -) but never the string itself, so
an answer that ends early with finish_reason "stop" means the string was split into characters."""

from __future__ import annotations

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.pml import ast
from rag_promptcache.store import MemoryStore

pytestmark = pytest.mark.smollm

NEVER = "zzzz-never"
QUESTION = ast.Prompt("", (ast.Role("user", (ast.Text("Name three colors of the rainbow."),)),))


@pytest.fixture(scope="module")
def engine(smollm):
    model, tokenizer = smollm
    return PromptCache(model, tokenizer, store=MemoryStore(), name="smollm2-135m-instruct")


def test_sampling_holds_a_bare_string_as_one_stop_string():
    assert Sampling(stop=NEVER).stop == (NEVER,)
    assert Sampling(stop=[NEVER, "x"]).stop == (NEVER, "x")
    assert Sampling(stop=None).stop == ()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop"):
        Sampling(stop=[NEVER, 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty"):
        Sampling(stop="")


def test_engine_generate_and_stream_take_a_bare_stop_string(engine):
    plain = engine.generate(QUESTION, max_new_tokens=12)
    assert set(plain.text) & set(NEVER), "the test needs an answer that contains letters of the stop string"
    for r in (engine.generate(QUESTION, max_new_tokens=12, stop=NEVER),
              engine.stream(QUESTION, max_new_tokens=12, stop=NEVER).consume()):
        assert (r.text, r.finish_reason) == (plain.text, plain.finish_reason)
    # a real stop string still stops: cut before the answer's second word
    word = plain.text.split()[1]
    stopped = engine.generate(QUESTION, max_new_tokens=12, stop=word)
    assert stopped.finish_reason == "stop" and stopped.text == plain.text[: plain.text.index(word)]


def test_corpus_ask_takes_a_bare_stop_string(smollm, engine, tmp_path):
    from rag_promptcache.rag import Corpus, Embedder

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "fruit.txt").write_text("The zorblat is a purple fruit that grows only on the island of Quenti.")
    corpus = Corpus.build([docs], tmp_path / "corpus", engine=engine, embedder=Embedder(), progress=False)
    plain = corpus.ask("What color is the zorblat?", k=1, max_new_tokens=12)
    assert set(plain.answer) & set(NEVER)
    stopped = corpus.ask("What color is the zorblat?", k=1, max_new_tokens=12, stop=NEVER)
    assert (stopped.answer, stopped.finish_reason) == (plain.answer, plain.finish_reason)


class _Ids:
    """A tokenizer of one character per id: decode(ids) is the characters, so the text is exact."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_a_repeated_sentence_ends_the_stream_before_the_repeat_is_shown():
    from rag_promptcache.engine.decoding.text import TextStream
    from rag_promptcache.rag.repetition import repeated_sentence

    text = "The cat sat on the mat. The dog ran far away. The cat sat on the mat. More."
    for stop_when, want in ((repeated_sentence, "The cat sat on the mat. The dog ran far away."), (None, text)):
        stream = TextStream(_Ids(), (), stop_when)
        shown = ""
        for ch in text:
            shown += stream.push(ord(ch))
            if stream.stopped:
                break
        shown += stream.finish()
        # a space after the last kept sentence may already be out when the repeat shows: never more
        assert shown.rstrip() == want and stream.text == shown
        assert stream.stopped == (stop_when is not None)


def test_every_entry_points_options_end_at_a_repeated_sentence_unless_turned_off():
    from rag_promptcache.rag.prompts import generation_options
    from rag_promptcache.rag.repetition import repeated_sentence

    assert generation_options({}, {})["stop_when"] is repeated_sentence
    assert "stop_when" not in generation_options({}, {"stop_repeats": False})
    assert Sampling(stop_when=repeated_sentence).stop_when is repeated_sentence
