"""role_markup: chat templates as fixed strings, checked against apply_chat_template."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rag_promptcache.model.chat import PLAIN_MARKUP, RoleMarkup, render, role_markup

CONVERSATIONS = [
    [("system", "You answer from the documents."), ("user", "Doc: Paris is in France.\n\nWhere is Paris?")],
    [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")],
    [("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "bye"), ("assistant", "ciao")],
    [("system", "multi\nline <b>markup</b> {{ not jinja }}"), ("user", "ünïcödé ✓")],
]

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
NUMBERED = (  # each turn carries its index: no fixed strings can reproduce it
    "{% for message in messages %}{{ loop.index|string + '. ' + message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def tokenizer_with(template: str | None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = template
    return tokenizer


def apply(tokenizer, messages, add_generation_prompt: bool) -> str:
    chat = [{"role": r, "content": c} for r, c in messages]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_smollm2_markup_re_renders_exactly(tokenizer):  # SmolLM2's tokenizer alone, no weights
    markup = role_markup(tokenizer)
    assert markup.from_template and not markup.trims_content
    assert markup.prefix == ""  # not the default system prompt the template injects
    assert markup.open == {r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}
    assert markup.close == {r: "<|im_end|>\n" for r in ("system", "user", "assistant")}
    assert markup.generation_prompt == "<|im_start|>assistant\n"
    for messages in CONVERSATIONS:
        for gen in (False, True):
            assert render(markup, messages, gen) == apply(tokenizer, messages, gen)


def test_smollm2_without_system_gets_the_injected_default(tokenizer):
    markup = role_markup(tokenizer)
    assert markup.default_system.startswith("<|im_start|>system\n") and "SmolLM" in markup.default_system
    messages = [("user", "hi"), ("assistant", "hello"), ("user", "bye")]
    assert render(markup, messages, True) == apply(tokenizer, messages, True)


def test_llama3_style_template_bos_prefix_and_trimming():
    tokenizer = tokenizer_with(LLAMA3)
    markup = role_markup(tokenizer)
    assert markup.from_template and markup.trims_content
    assert markup.prefix == "<s>"
    assert markup.open["system"] == "<|start_header_id|>system<|end_header_id|>\n\n"
    assert markup.close["assistant"] == "<|eot_id|>"
    for messages in [*CONVERSATIONS, [("system", "  padded  "), ("user", "\nq\n")]]:
        for gen in (False, True):
            assert render(markup, messages, gen) == apply(tokenizer, messages, gen)


def test_template_that_rejects_system_renders_system_as_a_user_turn():
    tokenizer = tokenizer_with(GEMMA)
    markup = role_markup(tokenizer)
    assert markup.from_template and markup.prefix == "<s>"
    assert markup.open == {"system": "<start_of_turn>user\n", "user": "<start_of_turn>user\n",
                           "assistant": "<start_of_turn>model\n"}
    assert markup.generation_prompt == "<start_of_turn>model\n"
    for messages in CONVERSATIONS:
        rest = [m for m in messages if m[0] != "system"]
        for gen in (False, True):
            assert render(markup, rest, gen) == apply(tokenizer, rest, gen)


@pytest.mark.parametrize("template", [None, NUMBERED])
def test_fallback_to_plain_markers(template):
    tokenizer = tokenizer_with(template)
    markup = role_markup(tokenizer)
    assert not markup.from_template
    assert markup.open == PLAIN_MARKUP.open and markup.close == PLAIN_MARKUP.close
    text = render(markup, [("system", "S"), ("user", "U")], add_generation_prompt=True)
    assert text == markup.prefix + "System: S\n\nUser: U\n\nAssistant: "


def test_render_rejects_unknown_roles():
    with pytest.raises(ValueError, match="valid roles"):
        render(PLAIN_MARKUP, [("tool", "x")], add_generation_prompt=False)


def test_markup_is_frozen():
    with pytest.raises(AttributeError):
        PLAIN_MARKUP.prefix = "x"  # type: ignore[misc]
    assert isinstance(PLAIN_MARKUP, RoleMarkup)
