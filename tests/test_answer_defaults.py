"""`ask`'s answer defaults are one record (`rag.repetition.ANSWER_DEFAULTS`) that every entry point takes:
the CLI's shown defaults (held equal here, since `--help` must not import torch), `Corpus.ask` and
retrieval, the server's unset `max_tokens`, the framework options, and both adapters' settings. What
each adapter actually asks of the engine: the adapters' own tests (test_*_answers.py)."""

from __future__ import annotations

import inspect

import pytest

from rag_promptcache.rag.repetition import ANSWER_DEFAULTS, repeated_sentence


def test_the_cli_and_the_server_show_and_use_the_record():
    from rag_promptcache.cli.commands import SHOWN_MAX_NEW_TOKENS, SHOWN_NO_REPEAT_NGRAM
    from rag_promptcache.server.protocol import DEFAULT_MAX_TOKENS

    assert SHOWN_MAX_NEW_TOKENS == DEFAULT_MAX_TOKENS == ANSWER_DEFAULTS.max_new_tokens
    assert SHOWN_NO_REPEAT_NGRAM == ANSWER_DEFAULTS.no_repeat_ngram


def test_corpus_ask_and_retrieval_default_to_the_record():
    from rag_promptcache.rag.chat import CorpusChat
    from rag_promptcache.rag.corpus import Corpus

    for method in (Corpus.ask, Corpus.retrieve, Corpus.retrieve_turns, CorpusChat.chat_prompt):
        assert inspect.signature(method).parameters["max_new_tokens"].default == ANSWER_DEFAULTS.max_new_tokens, method


def test_framework_options_are_the_record_where_nothing_is_set():
    from rag_promptcache.rag.prompts import generation_options

    assert generation_options({}, {}) == {"max_new_tokens": ANSWER_DEFAULTS.max_new_tokens, "temperature": ANSWER_DEFAULTS.temperature,
                                          "no_repeat_ngram": ANSWER_DEFAULTS.no_repeat_ngram, "stop": (),
                                          "stop_when": repeated_sentence}
    assert generation_options({"max_tokens": 64}, {"stop_repeats": False})["max_new_tokens"] == 64
    assert "stop_when" not in generation_options({}, {"stop_repeats": False})


@pytest.mark.parametrize("path", ["langchain_rag_promptcache:PromptCacheLLM", "langchain_rag_promptcache:ChatPromptCache",
                                  "llama_index.llms.rag_promptcache:PromptCacheLLM"])
def test_both_adapters_default_to_the_record(path):
    module, name = path.split(":")
    cls = getattr(pytest.importorskip(module), name)
    fields = cls.model_fields
    assert (fields["max_tokens"].default, fields["temperature"].default, fields["no_repeat_ngram"].default,
            fields["stop_repeats"].default) == (ANSWER_DEFAULTS.max_new_tokens, ANSWER_DEFAULTS.temperature,
                                                ANSWER_DEFAULTS.no_repeat_ngram, ANSWER_DEFAULTS.stop_repeats)
