"""JSON answers under a small token budget: `response_format={"type": "json_object"}` with `max_tokens`
64, as a new user first tried it.

Every question of the serve scenario's pool (bench/serve_questions.py `TIMED`, the first `json_questions`),
with "Answer as a JSON object." after it, through the chat route's prompt over the demo corpus (k 4, the
server's own `CorpusChat`), greedy, with the repetition control the server applies by default
(rag/repetition.py `answer_options`). Per answer: whether its text parses as a JSON object, its finish
reason, its longest key and longest string (characters), its tokens. The summary counts the answers
that parse and the ones the budget cut; the JSON keeps every answer's text.

Not here: speed (the grammar's cost per token is in `decode`), schemas other than any object.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, closing

from rag_promptcache.bench.common import Bench
from rag_promptcache.bench.serve import demo_corpus
from rag_promptcache.bench.serve_questions import TIMED
from rag_promptcache.rag.repetition import answer_options
from rag_promptcache.store import MemoryStore

INSTRUCTION = "Answer as a JSON object."
K = 4


def run(bench: Bench) -> dict[str, object]:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.chat import CorpusChat

    cfg = bench.config
    answers: list[dict[str, object]] = []
    with ExitStack() as stack:
        store = stack.enter_context(closing(MemoryStore()))
        engine = PromptCache(bench.model, bench.tokenizer, store=store, name=bench.model_name, **bench.engine_options)
        corpus = demo_corpus(bench, engine, [])
        stack.callback(corpus.close)
        chat = CorpusChat(corpus)
        options = answer_options({"max_new_tokens": cfg.json_max_tokens, "temperature": 0.0,
                                  "response_format": {"type": "json_object"}})
        for question in TIMED[: cfg.json_questions]:
            built = chat.chat_prompt([("user", f"{question} {INSTRUCTION}")], k=K, max_new_tokens=cfg.json_max_tokens)
            result = engine.generate(built.prompt, **options)
            answers.append(_judge(question, result.text, result.finish_reason, result.num_generated))
            bench.log(f"json: {answers[-1]['finish_reason']}, {'valid' if answers[-1]['valid'] else 'INVALID'}, "
                      f"longest key {answers[-1]['longest_key']}: {result.text[:120]!r}")
    return summary(answers, cfg.json_max_tokens)


def _judge(question: str, text: str, finish: str, tokens: int) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    keys, strings = _strings(value) if value is not None else ([], [])
    if value is None:  # cut off: the longest key or string is read from the text itself
        keys, strings = _raw_strings(text)
    return {"question": question, "text": text, "finish_reason": finish, "tokens": tokens,
            "valid": isinstance(value, dict), "longest_key": max(map(len, keys), default=0),
            "longest_string": max(map(len, strings), default=0)}


def _strings(value: object) -> tuple[list[str], list[str]]:
    """The keys and the string values of a parsed JSON value, at any depth."""
    keys: list[str] = []
    strings: list[str] = []

    def walk(v: object) -> None:
        if isinstance(v, dict):
            keys.extend(v)
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            strings.append(v)

    walk(value)
    return keys, strings


def _raw_strings(text: str) -> tuple[list[str], list[str]]:
    """The keys and strings of JSON text that may be cut off: each quoted run, a key where a ':' follows
    it (an unterminated last one counts as a key when it was one; as a string otherwise)."""
    keys: list[str] = []
    strings: list[str] = []
    for body, closed, after in _quoted(text):
        is_key = after.lstrip().startswith(":") if closed else _expects_key(text[: len(text) - len(body) - 1])
        (keys if is_key else strings).append(body)
    return keys, strings


def _quoted(text: str) -> Iterator[tuple[str, bool, str]]:
    i = 0
    while (start := text.find('"', i)) >= 0:
        j, escaped = start + 1, False
        while j < len(text) and (escaped or text[j] != '"'):
            escaped = not escaped and text[j] == "\\"
            j += 1
        yield text[start + 1 : j], j < len(text), text[j + 1 :]
        i = j + 1


def _expects_key(before: str) -> bool:
    return before.rstrip()[-1:] in ("{", ",") and before.count("{") > before.count("}")


def summary(answers: list[dict[str, object]], max_tokens: int) -> dict[str, object]:
    n = len(answers)
    keys = sorted(a["longest_key"] for a in answers)
    return {"questions": n, "max_tokens": max_tokens, "k": K, "instruction": INSTRUCTION,
            "valid": sum(a["valid"] for a in answers), "cut_by_budget": sum(a["finish_reason"] == "length" for a in answers),
            "longest_key_median": keys[n // 2] if n else 0, "longest_key_max": keys[-1] if n else 0,
            "tokens_mean": sum(a["tokens"] for a in answers) / n if n else 0.0, "answers": answers}
