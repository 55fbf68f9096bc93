"""A chatbot's turns: time to first token of each of `chat_turns` questions over the same documents.

The prompt of a turn is what a chat turn over a corpus builds (rag/chat.py → rag/prompts.build_prompt
→ pml.build.prompt_pml): the corpus schema (instructions, then ~`chat_context` tokens of modules in
its system turn), the modules imported in the same order every turn (retrieval returned the same
documents), the earlier turns as user/assistant history, the new question. Systems, per turn, one
after the other (interleaved turn by turn):
- `engine`: `PromptCache.generate` on that prompt as the engine runs by default, every module in
  its memory store; TTFT is `Result.ttft_s` (from the call to the first token). Its greedy answer
  (at most `chat_answer_tokens`, the corpus's no-repeat rule) enters the history.
- `llamacpp_bf16`, `llamacpp_q4_1` (where llama-cpp-python is installed, bench/llamacpp.py): the
  same prompt's token ids (the engine's own, `plan(use_cache=False)`) through `Runner.reuse`: the
  state kept from the previous turn is reused up to the longest common prefix, the rest computed,
  as a llama.cpp slot does. After its TTFT, the engine's answer tokens enter its state untimed, as
  if llama.cpp had generated the same answer, so the next turn reuses through it (its best case).
A conversation runs `chat_repeats` times, the questions rotated each time so no prompt repeats an
earlier one exactly. Reported: each turn's TTFT per system, llama.cpp's reused tokens, the median
of turns 2..n per system and the ratios (llama.cpp over ours: above 1, ours is sooner).

Not here: answer quality (fidelity.py), decode speed (decode.py), TTFT against context (ttft.py).
"""

from __future__ import annotations

import random

from rag_promptcache.bench import llamacpp
from rag_promptcache.bench.common import Bench, median, module_texts, schema_pml
from rag_promptcache.engine import PromptCache
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.store import MemoryStore
from rag_promptcache.timing import describe, ratio

SCHEMA = "bench_chat"
ENGINE = "engine"
# about the first pydoc topics (assert, assignment, async, atoms, attributes, augassign, ...)
QUESTIONS = (
    "What does the assert statement do?",
    "When are assert statements left out of the compiled code?",
    "How is an assignment to a target list carried out?",
    "What happens when the target of an assignment is an attribute reference?",
    "What is an augmented assignment statement, and how does it differ from a normal one?",
    "Which of these documents talk about async, and what do they say?",
)


def run(bench: Bench) -> dict[str, object]:
    from rag_promptcache.rag.corpus import DEFAULT_NO_REPEAT_NGRAM

    cfg, tok = bench.config, bench.tokenizer
    if not 1 <= cfg.chat_turns <= len(QUESTIONS):
        raise ValueError(f"chat_turns must be 1..{len(QUESTIONS)}, got {cfg.chat_turns}")
    m = max(1, cfg.chat_context // cfg.module_tokens)
    schema = schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(module_texts(tok, m, cfg.module_tokens))})
    order = [f"d{i}" for i in range(m)]
    random.Random(m).shuffle(order)  # one order, kept every turn
    # the engine as a chatbot runs it (the prefix cache on), and without the prefix cache on the same
    # store: the answers must be equal, and the second is what every turn cost before the prefix cache
    options = {**bench.engine_options, "prefix_cache_bytes": None}  # None: the store config's default
    pc = PromptCache(bench.model, tok, store=MemoryStore(), name=bench.model_name, **options)
    pc.add_schema(schema)
    pc.encode(SCHEMA)
    off = PromptCache(bench.model, tok, store=pc.store, name=bench.model_name, **bench.engine_options)
    off.add_schema(schema)
    budget = cfg.chat_context + 256 + cfg.chat_turns * (cfg.chat_answer_tokens + 64)
    llama = llamacpp.runners(bench, budget + 256) or {}
    if not llama:
        bench.log("chat: llama.cpp rows skipped (llama-cpp-python not installed, turned off, or not the default model)")

    def answer(prompt: str, engine: PromptCache = pc):
        return engine.generate(prompt, max_new_tokens=cfg.chat_answer_tokens, no_repeat_ngram=DEFAULT_NO_REPEAT_NGRAM)

    warm = prompt_pml(SCHEMA, order, [("user", QUESTIONS[-1])])  # warm-up, outside any conversation
    answer(warm)
    answer(warm, off)
    for r in llama.values():
        r.full([i for p in pc.plan(warm, use_cache=False).pieces for i in p.token_ids])
    eos = set(_eos_ids(tok))
    turns: list[dict[str, object]] = []
    for rep in range(cfg.chat_repeats):
        questions = [QUESTIONS[(rep + i) % len(QUESTIONS)] for i in range(cfg.chat_turns)]
        history: list[tuple[str, str]] = []
        for t, q in enumerate(questions, start=1):
            prompt = prompt_pml(SCHEMA, order, [*history, ("user", q)])
            ids = [i for p in pc.plan(prompt, use_cache=False).pieces for i in p.token_ids]
            res = answer(prompt)
            ref = answer(prompt, off)
            answer_ids = list(res.token_ids)
            while answer_ids and answer_ids[-1] in eos:
                answer_ids.pop()
            row: dict[str, object] = {"repeat": rep, "turn": t, "prompt_tokens": len(ids), "engine_s": res.ttft_s,
                                      "engine_cached_tokens": res.cached_tokens,
                                      "engine_computed_tokens": res.computed_tokens, "answer_tokens": len(answer_ids),
                                      "engine_prefix_tokens": res.num_prefix_tokens,
                                      "engine_no_prefix_s": ref.ttft_s, "engine_no_prefix_computed_tokens": ref.computed_tokens,
                                      "answers_equal_prefix_off": res.token_ids == ref.token_ids}
            for w, r in llama.items():
                seconds, first, reused = r.reuse(ids)
                r.extend(answer_ids)
                row.update({f"llamacpp_{w}_s": seconds, f"llamacpp_{w}_reused_tokens": reused,
                            f"llamacpp_{w}_first_token_match": first == res.token_ids[0]})
            turns.append(row)
            bench.log(f"chat repeat {rep} turn {t}: {len(ids)} tokens, engine {res.ttft_s:.3f} s "
                      f"({res.num_prefix_tokens} from the prefix cache; {ref.ttft_s:.3f} s without it"
                      f"{'' if row['answers_equal_prefix_off'] else ', ANSWER DIFFERS'})"
                      + "".join(f", llama.cpp {w} {row[f'llamacpp_{w}_s']:.3f} s "
                                f"(reused {row[f'llamacpp_{w}_reused_tokens']})" for w in llama))
            history += [("user", q), ("assistant", res.text)]
    return _summary(bench, turns, list(llama), m)


def _summary(bench: Bench, turns: list[dict[str, object]], weights: list[str], modules: int) -> dict[str, object]:
    later = [t for t in turns if t["turn"] >= 2]
    out: dict[str, object] = {
        "turns": bench.config.chat_turns, "repeats": bench.config.chat_repeats, "modules": modules,
        "context_tokens": modules * bench.config.module_tokens, "answer_tokens": bench.config.chat_answer_tokens,
        "engine_median_s": median([t["engine_s"] for t in later]),
        "engine_turn1_median_s": median([t["engine_s"] for t in turns if t["turn"] == 1]),
        "engine_no_prefix_median_s": median([t["engine_no_prefix_s"] for t in later]),
        "answers_equal_prefix_off": sum(bool(t["answers_equal_prefix_off"]) for t in turns),
        "num_answers": len(turns),
    }
    for w in weights:
        out[f"llamacpp_{w}_median_s"] = median([t[f"llamacpp_{w}_s"] for t in later])
        out[f"llamacpp_{w}_turn1_median_s"] = median([t[f"llamacpp_{w}_s"] for t in turns if t["turn"] == 1])
        out[f"x_llamacpp_{w}"] = ratio(out[f"llamacpp_{w}_median_s"], out["engine_median_s"])
    if weights:
        out["llamacpp"] = llamacpp.info(bench)
    out["rows"] = turns
    bench.log(f"chat turns 2-{bench.config.chat_turns} median TTFT: engine {out['engine_median_s']:.3f} s "
              f"(without the prefix cache {out['engine_no_prefix_median_s']:.3f} s; answers equal "
              f"{out['answers_equal_prefix_off']}/{out['num_answers']})"
              + "".join(f", llama.cpp {w} {out[f'llamacpp_{w}_median_s']:.3f} s ({describe(out[f'x_llamacpp_{w}'], '.2f', 'x')} ours)"
                        for w in weights))
    return out


def _eos_ids(tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return [i for i in ids if isinstance(i, int) and i >= 0]

