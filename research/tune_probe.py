"""The fidelity benchmark's prompts, retrieved as `Corpus.ask` retrieves them, written out as text
(instructions, module texts in prompt order, question, answer) for `tune.probe` to read on another
machine, and graded back here with the benchmark's own rule.

`python -m research.tune_probe dump out.json` builds each split's corpus (the real
embedder and FAISS; a tiny random LLM stands in for encoding, since retrieval and chunking depend
only on the embedder and the tokenizer), then `grade out.json answers.json` scores answers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rag_promptcache.bench.fidelity import SPLITS, STOP, split_data
from rag_promptcache.rag.fidelity import answer_contains

def dump(out: Path, draws: tuple[int, ...] = (0, 1), ks: tuple[int, ...] = (4, 8, 12)) -> list[dict[str, object]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rag_promptcache.engine import PromptCache
    from rag_promptcache.model.loading import load_tokenizer
    from rag_promptcache.rag import Corpus

    tok = load_tokenizer()
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    stand_in = AutoModelForCausalLM.from_config(config).eval()
    rows: list[dict[str, object]] = []
    for split in SPLITS:
        for draw in draws:
            data, chunk = split_data(split, seed_offset=draw)
            with tempfile.TemporaryDirectory() as tmp:
                engine = PromptCache(stand_in, tok, fallback="never", prefix_cache_bytes=0)
                corpus = Corpus.build(data.documents, f"{tmp}/c", engine=engine, progress=False,
                                      chunk_tokens=chunk)
                for k in ks:
                    for q in data.questions:
                        ids = corpus.order([m for m, _ in corpus.search(q.question, k)])
                        rows.append({"split": split, "draw": draw, "k": k, "question": q.question, "answer": q.answer,
                                     "instructions": corpus.manifest.instructions,
                                     "modules": [corpus.table.module(m)[0] for m in ids],
                                     "prompt": corpus.prompt(q.question, ids)})
                corpus.close()
    out.write_text(json.dumps(rows))
    return rows


def cut(text: str) -> str:
    """The answer as the benchmark judges it: up to its first stop string."""
    ends = [i for s in STOP if (i := text.find(s)) >= 0]
    return text[: min(ends) + 1] if ends else text


def grade(rows: list[dict[str, object]], answers: dict[str, list[str]]) -> list[dict[str, object]]:
    """Per (split, k) and setting: right answers, and `kept` against the reference setting `base/full`."""
    table: dict[tuple[str, int], dict[str, list[bool]]] = {}
    for setting, texts in answers.items():
        for row, text in zip(rows, texts):
            table.setdefault((row["split"], row["k"]), {}).setdefault(setting, []).append(
                answer_contains(cut(text), str(row["answer"])))
    out = []
    for (split, k), by in sorted(table.items()):
        ref = by.get("base/full")
        for setting, right in by.items():
            kept = None
            if ref is not None and sum(ref):
                kept = sum(r and s for r, s in zip(ref, right)) / sum(ref)
            out.append({"split": split, "k": k, "setting": setting, "right": sum(right), "of": len(right),
                        "retained": sum(right) / sum(ref) if ref and sum(ref) else None, "kept": kept})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.tune_probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write the fidelity prompts as text")
    d.add_argument("out", type=Path)
    g = sub.add_parser("grade", help="grade answers written by tune.recipe --probe")
    g.add_argument("rows", type=Path)
    g.add_argument("answers", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        print(f"{len(dump(args.out))} prompts written to {args.out}")
    else:
        rows = json.loads(args.rows.read_text())
        for r in grade(rows, json.loads(args.answers.read_text())):
            print(json.dumps(r))


if __name__ == "__main__":
    main()
