"""Requests from chat frameworks → engine calls (rag_promptcache.rag.prompts). Imports of known
modules are covered end to end, with a real corpus, by the adapters' tests."""

from __future__ import annotations

import pytest

from rag_promptcache.pml import ast
from rag_promptcache.rag.prompts import build_prompt, format_refs, generation_options, result_stats


def test_references_without_a_corpus_fall_back_to_their_text():
    refs = format_refs([("m1", "Paris <is> big & old"), ("m2", "Rome")])
    assert refs == '<module id="m1">Paris &lt;is&gt; big &amp; old</module>\n<module id="m2">Rome</module>'
    prompt = build_prompt([("user", f"Context:\n{refs}\n\nQ?")], chat=False)
    assert prompt == "Context:\nParis <is> big & old\nRome\n\nQ?"


def test_chat_without_modules_uses_the_empty_schema():
    prompt = build_prompt([("system", "Be brief."), ("user", "Hi")])
    assert isinstance(prompt, ast.Prompt) and prompt.schema == ""
    assert [(r.role, r.children[0].text) for r in prompt.children] == [("system", "Be brief."), ("user", "Hi")]


def test_explicit_module_ids_with_text_go_before_the_last_turn():
    prompt = build_prompt([("user", "Q?")], module_ids=[("m9", "Fact.")], chat=False)
    assert prompt == "Fact.\n\nQ?"


def test_pml_passes_through_and_errors_are_clear():
    pml = '<prompt schema="s"><a/>Q</prompt>'
    assert build_prompt([("user", pml)], chat=False) == pml
    with pytest.raises(ValueError, match="unknown module 'm7'.*no text to fall back on"):
        build_prompt([("user", 'x <module id="m7"/>')])
    with pytest.raises(ValueError, match="unknown module 'm8'"):
        build_prompt([("user", "x")], module_ids=["m8"])
    with pytest.raises(ValueError, match="empty prompt"):
        build_prompt([("user", "   ")])


def test_generation_options():
    defaults = {"max_tokens": 256, "temperature": 0.0, "top_p": None, "stop": ["\n\n"]}
    from rag_promptcache.rag.repetition import repeated_sentence

    assert generation_options(defaults, {"max_tokens": 8, "stop": None}) == {
        "max_new_tokens": 8, "temperature": 0.0, "stop": ["\n\n"],  # Sampling makes a tuple of it
        # every entry point ends at a repeated sentence (stop_repeats=False: off) and bans repeated n-grams
        # (rag.repetition.answer_options, the one place both are applied)
        "stop_when": repeated_sentence, "no_repeat_ngram": 6}
    assert generation_options(defaults, {"no_repeat_ngram": 0, "stop_repeats": False})["no_repeat_ngram"] == 0
    assert "stop_when" not in generation_options(defaults, {"stop_repeats": False})
    assert generation_options(defaults, {"stop": ["END"]})["stop"] == ["END"]
    assert generation_options(defaults, {"stop": "END"})["stop"] == "END"  # one stop string, never its characters
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        generation_options(defaults, {"max_tokens": 0})
    with pytest.raises(ValueError, match=r"unsupported option\(s\) \['beams'\]; valid: max_tokens"):
        generation_options(defaults, {"beams": 2})
    assert result_stats(None) == {}
