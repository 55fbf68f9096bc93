"""A compiled prompt with role tags is, token for token, what the tokenizer's own
`apply_chat_template(messages, tokenize=True, add_generation_prompt=True)` gives for the same
conversation: one BOS whether the post-processor adds it, the template writes it, both or neither;
the default system turn a template injects when the conversation does not start with one; the
corpus case, where module text sits inside the system turn. Tokenizers are built here from
SmolLM2's BPE with the `tokenizers` library, plus SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from rag_promptcache.engine import PromptCache
from rag_promptcache.pml import ast
from rag_promptcache.store import MemoryStore
from tests.tiny import build

BOS = "{{ bos_token }}"
TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADERS = (  # Llama-3 layout, without its trimming
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
)

STYLES = {  # name: (post-processor adds BOS, chat template)
    "post_processor_bos": (True, TURNS),
    "template_bos": (False, BOS + TURNS),
    "both_bos": (True, BOS + TURNS),
    "no_bos": (False, TURNS),
    "llama3_headers_both_bos": (True, BOS + HEADERS),
    "default_system_both_bos": (True, BOS + DEFAULT_SYSTEM + TURNS),
    "default_system_no_bos": (False, DEFAULT_SYSTEM + TURNS),
}

RAG_SCHEMA = """<schema name="rag"><system>Answer from the documents.

<module name="d1">Paris is the capital of France. It lies on the Seine.</module>
<module name="d2">Mount Fuji is the highest mountain in Japan.</module></system></schema>"""
INSTRUCTIONS = "Answer from the documents.\n\n"
D1 = "Paris is the capital of France. It lies on the Seine."
D2 = "Mount Fuji is the highest mountain in Japan."

# (prompt, the same conversation as messages)
CASES = [
    ('<prompt schema="rag"><d1/><d2/><user>Where is Paris?</user></prompt>',
     [("system", INSTRUCTIONS + D1 + D2), ("user", "Where is Paris?")]),
    ('<prompt schema="rag"><d2/><user>How high is Fuji?</user></prompt>',
     [("system", INSTRUCTIONS + D2), ("user", "How high is Fuji?")]),
    ('<prompt schema="rag"><d1/><user>Hi</user><assistant>Hello.</assistant><user>And Lyon?</user></prompt>',
     [("system", INSTRUCTIONS + D1), ("user", "Hi"), ("assistant", "Hello."), ("user", "And Lyon?")]),
    (ast.Prompt("", (ast.Role("user", (ast.Text("What is 2+2?"),)),)),
     [("user", "What is 2+2?")]),
    (ast.Prompt("", (ast.Role("system", (ast.Text("Be brief."),)), ast.Role("user", (ast.Text("Name a colour."),)))),
     [("system", "Be brief."), ("user", "Name a colour.")]),
    (ast.Prompt("", tuple(ast.Role(r, (ast.Text(t),)) for r, t in
                          [("user", "One"), ("assistant", "Two"), ("user", "Three?")])),
     [("user", "One"), ("assistant", "Two"), ("user", "Three?")]),
]


@pytest.fixture(scope="module")
def smollm_backend(tokenizer) -> str:
    return tokenizer.backend_tokenizer.to_str()


def styled(backend_json: str, post_processor_bos: bool, template: str) -> PreTrainedTokenizerFast:
    backend = Tokenizer.from_str(backend_json)
    backend.add_special_tokens(["<s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    if post_processor_bos:
        bos_id = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>")
    tok.chat_template = template
    return tok


def reference(tok, messages) -> list[int]:
    chat = [{"role": r, "content": c} for r, c in messages]
    return list(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False))


def check(tok) -> PromptCache:
    # the cached plan always (`fallback="never"`): its pieces are what is checked, and the cost model's
    # calibration, which "auto" would run first, takes seconds under the coarse clock of `make test-coarse`
    pc = PromptCache(build("llama", vocab_size=len(tok)), tok, store=MemoryStore(), recovery="none", fallback="never")
    pc.add_schema(RAG_SCHEMA)
    for prompt, messages in CASES:
        want = reference(tok, messages)
        for use_cache in (False, True):  # the full-prefill sequence and the cached assembly's
            pieces = sorted(pc.plan(prompt, use_cache=use_cache).pieces, key=lambda p: p.position)
            got = [t for p in pieces for t in p.token_ids]
            assert got == want, (prompt, use_cache, tok.convert_ids_to_tokens(got), tok.convert_ids_to_tokens(want))
    return pc


@pytest.mark.parametrize("style", STYLES)
def test_compiled_chat_equals_apply_chat_template(style, smollm_backend):
    post_processor_bos, template = STYLES[style]
    tok = styled(smollm_backend, post_processor_bos, template)
    assert (tok("a")["input_ids"][0] == tok.bos_token_id) == post_processor_bos  # the style is what it says
    pc = check(tok)
    bos = tok.bos_token_id
    for prompt, _ in CASES:
        ids = [t for p in pc.plan(prompt, use_cache=False).pieces for t in p.token_ids]
        assert ids.count(bos) == (1 if BOS in template else 0), style
    plain = [t for p in pc.plan("Hello there", use_cache=False).pieces for t in p.token_ids]
    assert plain == tok("Hello there")["input_ids"]  # plain text keeps the tokenizer's own BOS


def test_smollm2_compiled_chat_equals_apply_chat_template(tokenizer):
    pc = check(tokenizer)
    assert "SmolLM" in pc.compiler.markup.default_system  # the template's injected system turn
