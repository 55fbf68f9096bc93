"""What the LangChain and LlamaIndex adapters' tests share (integrations/*/tests): the real SmolLM2 engine,
made once per test process for both (cached loaders, because langchain-tests' standard suites take
constructor params from properties, where fixtures cannot reach), a tiny corpus of facts, and a recorder of
what an adapter asked of the engine.

An answer through either adapter shares with `ask`: a question the window cannot take raises by name,
sources name the section (`file › section`), and the answer defaults are `ask`'s (one record,
`rag.prompts.ANSWER_DEFAULTS`); `ask_defaults` and `options_of` check the last."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable

import pytest

from tests.shared_model import default_smollm, set_torch_threads

set_torch_threads()

FACTS = [
    "The Eiffel Tower is in Paris. It was completed in 1889.",
    "Mount Fuji is the highest mountain in Japan, at 3776 metres.",
    "The Amazon is the largest rainforest on Earth, mostly in Brazil.",
    "Python was created by Guido van Rossum and first released in 1991.",
    "Honey never spoils: edible honey has been found in ancient Egyptian tombs.",
]
LONG = " ".join(["word"] * 9000)  # 45,000 characters, 9,000 tokens: past SmolLM2's 8,192-token window
QUESTION = "When was the Eiffel Tower completed?"


@functools.cache
def engine():
    """`PromptCache.from_pretrained("smollm2-135m-instruct")`, over the process's one default model."""
    from rag_promptcache.engine import PromptCache

    model, tokenizer = default_smollm()
    return PromptCache(model, tokenizer, name="smollm2-135m-instruct")


@pytest.fixture(scope="session", name="engine")
def engine_fixture():
    """The one SmolLM2 engine of the session (each adapter's corpus uses it too); its conftest imports it."""
    return engine()


def build_corpus(documents: list, prefix: str):
    """A corpus of `documents` (an adapter's own document type) built with `engine()`, in a folder removed
    when the process ends."""
    from rag_promptcache.rag import Corpus

    root = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, root, True)
    return Corpus.build(documents, f"{root}/corpus", engine=engine(), progress=False)


def tower_corpus(tmp_path):
    """A corpus of one Markdown file whose one section, "Eiffel Tower", answers `QUESTION`."""
    from rag_promptcache.rag import Corpus

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tower.md").write_text("## Eiffel Tower\n\nThe Eiffel Tower is in Paris. It was completed in 1889.")
    return Corpus.build([tmp_path / "docs"], tmp_path / "c", engine=engine(), progress=False)


class Asked(list):
    """The keyword options of each call of an engine's `generate` and `stream`, oldest first (the engine's
    own calls inside one come after it); `cap`: each runs with at most this many new tokens."""

    cap: int | None = None


def record_calls(engine, monkeypatch) -> Asked:
    calls = Asked()
    for name in ("generate", "stream"):
        real = getattr(engine, name)

        @functools.wraps(real)
        def record(prompt, _real=real, **options):
            calls.append(options)
            ran = options if calls.cap is None else {**options, "max_new_tokens": min(options.get("max_new_tokens", calls.cap), calls.cap)}
            return _real(prompt, **ran)

        monkeypatch.setattr(engine, name, record)
    return calls


@pytest.fixture
def asked(engine, monkeypatch) -> Asked:
    """What the adapter asked of the engine, call by call (`Asked`); the real engine runs."""
    return record_calls(engine, monkeypatch)


def options_of(asked: Asked, call: Callable[[], object]) -> dict:
    """The options `call` asked of the engine first, no stop strings however spelt."""
    first = len(asked)
    call()
    return {k: v for k, v in asked[first].items() if not (k == "stop" and not v)}


def ask_defaults(corpus, asked: Asked) -> dict:
    """What `corpus.ask` asks of the engine: the answer defaults, checked here."""
    from rag_promptcache.rag.prompts import ANSWER_DEFAULTS
    from rag_promptcache.rag.repetition import repeated_sentence

    ask = options_of(asked, lambda: corpus.ask(QUESTION))
    assert ask == {"max_new_tokens": ANSWER_DEFAULTS.max_new_tokens, "temperature": ANSWER_DEFAULTS.temperature,
                   "no_repeat_ngram": ANSWER_DEFAULTS.no_repeat_ngram, "stop_when": repeated_sentence}
    return ask
