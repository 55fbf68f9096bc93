"""What an answer through LlamaIndex shares with `ask`: a question the window cannot take raises by name,
nodes name the section (`file › section`), and the answer defaults are `ask`'s (one record,
`rag.repetition.ANSWER_DEFAULTS`). The real engine runs; a wrapper records what each path asked of it
and generates two tokens (`asked`, conftest.py)."""

from __future__ import annotations

import pytest
from llama_index.llms.rag_promptcache import PromptCacheLLM, PromptCacheQueryEngine
from llama_index.retrievers.rag_promptcache import PromptCacheRetriever, corpus_nodes
from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.rag.prompts import ANSWER_DEFAULTS
from rag_promptcache.rag.repetition import repeated_sentence

pytestmark = pytest.mark.smollm
LONG = " ".join(["word"] * 9000)  # 45,000 characters, 9,000 tokens: past SmolLM2's 8,192-token window


def test_a_question_past_the_window_raises_by_name(corpus):
    with pytest.raises(ContextWindowExceeded, match="8192-token context window"):
        PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2).query(LONG)
    with pytest.raises(ContextWindowExceeded, match="8192-token context window"):
        PromptCacheLLM(corpus=corpus).complete(LONG)


def test_nodes_name_the_section(engine, tmp_path):
    from rag_promptcache.rag import Corpus

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tower.md").write_text("## Eiffel Tower\n\nThe Eiffel Tower is in Paris. "
                                               "It was completed in 1889.")
    md = Corpus.build([tmp_path / "docs"], tmp_path / "c", engine=engine, progress=False)
    node = PromptCacheRetriever(md, similarity_top_k=1).retrieve("When was the Eiffel Tower completed?")[0].node
    assert (node.metadata["source"], node.metadata["where"]) == ("tower.md", "tower.md › Eiffel Tower")
    assert node.metadata["where"] == "tower.md › Eiffel Tower"
    stock = corpus_nodes(md)[0]
    assert stock.metadata["where"] == "tower.md › Eiffel Tower"
    from llama_index.core.schema import MetadataMode

    assert "Eiffel Tower" not in stock.get_content(MetadataMode.LLM).split(">", 1)[0]  # the reference tag holds the id only


def _same(options: dict) -> dict:
    return {k: v for k, v in options.items() if not (k == "stop" and not v)}  # no stop strings, however spelt


def test_the_answer_defaults_are_asks(corpus, asked):
    asked.cap = 2  # what was asked is checked, not the answers
    question = "When was the Eiffel Tower completed?"
    first = len(asked)
    corpus.ask(question)
    ask = _same(asked[first])
    assert ask == {"max_new_tokens": ANSWER_DEFAULTS.max_new_tokens, "temperature": ANSWER_DEFAULTS.temperature,
                   "no_repeat_ngram": ANSWER_DEFAULTS.no_repeat_ngram, "stop_when": repeated_sentence}
    first = len(asked)
    PromptCacheLLM(corpus=corpus).complete(question)
    assert _same(asked[first]) == ask
    first = len(asked)
    PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2).query(question)
    assert _same(asked[first]) == ask
    first = len(asked)
    PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, max_tokens=64).query(question)  # the one knob
    assert asked[first]["max_new_tokens"] == 64
