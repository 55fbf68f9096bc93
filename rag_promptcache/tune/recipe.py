"""The tuning recipe in one command: text → samples → LoRA → probe before and after → adapter.

    python -m rag_promptcache.tune.recipe --out DIR [--model NAME|PATH] [--seconds S] [--steps N]
        [--passages passages.json] [--probe probe.json] [--device cuda] [--seed 0]

`--passages`: a bundle written by `--write-passages` (instructions and passages), so another machine
trains on exactly this machine's text; without it, `texts.gather()` reads this machine's. `--probe`:
prompts written by `python -m research.tune_probe dump`, answered greedily by the base
and the tuned model with full prefill and with modules encoded on their own (`probe.py`); the
answers go to DIR/probe_answers.json for `tune_probe grade`.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from rag_promptcache.tune.layout import Laid, Layouter
from rag_promptcache.tune.samples import SampleMaker, shared_fact_neighbors
from rag_promptcache.tune.texts import FAMILIES, Passage, gather, held_out
from rag_promptcache.tune.train import TuneConfig, bf16_autocast, max_len_for, train

FORMAT = 1
_worker: tuple[SampleMaker, Layouter, list[list[int]], int] | None = None


def _init(maker: SampleMaker, tokenizer, mode: str, link_ids: tuple[int, ...] = (),
          wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()), near: list[list[int]] | None = None,
          present: int = 0) -> None:
    global _worker
    _worker = (maker, Layouter(tokenizer, mode, link_ids, wrap), near or [], present)


def _lay(index: int) -> tuple[int, Laid]:
    assert _worker is not None
    maker, layouter, near, present = _worker
    s = maker(index)
    mods = [module_text(maker.passages[i]) for i in s.passages]
    after = [[module_text(maker.passages[j]) for j in near[i]] for i in s.passages] if near else ()
    return index, layouter.lay(s.instructions, mods, s.question, s.answer, neighbours=after, present=present)


def nearest_passages(passages: list[Passage], m: int, path: Path | None = None) -> list[list[int]]:
    """Each passage's `m` nearest others by the corpus embedder, least similar first, as `ingest --neighbours M`
    chooses a module's (rag/neighbours.py: identical texts skipped, ties by index): what training prompts lay
    their modules after (`--neighbours`). Read from `path` where it holds lists for these passages, else
    computed and written there (a machine without the embedder reads what another wrote)."""
    if path is not None and path.exists():
        near = json.loads(path.read_text())
        if len(near) == len(passages) and all(len(n) >= min(m, len(passages) - 1) for n in near):
            return [n[len(n) - m:] for n in near]
        raise ValueError(f"{path} holds neighbour lists for other passages or fewer than {m} each")
    from rag_promptcache.rag.models import load_embedder

    texts = [module_text(p) for p in passages]
    vectors = load_embedder(None).embed(texts)
    alike: dict[str, list[int]] = {}
    for j, t in enumerate(texts):
        alike.setdefault(t, []).append(j)
    near, index = [], np.arange(len(texts))
    for start in range(0, len(texts), 512):
        sims = (vectors[start:start + 512] @ vectors.T).astype(np.float64)
        for row, i in zip(sims, range(start, start + len(sims))):
            row[alike[texts[i]]] = -np.inf  # itself and its copies
            ranked = [int(j) for j in np.lexsort((index, -row))[:m] if row[j] > -np.inf]
            near.append(ranked[::-1])
    if path is not None:
        path.write_text(json.dumps(near))
    return near


def module_text(p: Passage) -> str:
    """A passage as a corpus module holds it: its source label, then its text (rag/chunker.py); a
    passage without a label is a corpus's module text already."""
    return f"[{p.label}]\n{p.text.strip()}\n\n" if p.label else p.text


def write_passages(path: Path, instructions: str) -> None:
    path.write_text(json.dumps({"instructions": instructions, "passages": [asdict(p) for p in gather()]}))


def read_json(path: Path):
    """JSON, gzipped where the name ends in .gz (what travels to another machine)."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def read_passages(path: Path) -> tuple[str, list[Passage]]:
    raw = read_json(path)
    return raw["instructions"], [Passage(**{**p, "facts": tuple(tuple(f) for f in p["facts"])}) for p in raw["passages"]]


def probe_prompts(rows: list[dict[str, object]], layouter: Layouter) -> list[Laid]:
    return [layouter.lay(str(r["instructions"]), list(r["modules"]), str(r["question"]), "") for r in rows]


def answer_all(model, tokenizer, prompts: list[Laid], full: bool, batch: int) -> list[str]:
    from rag_promptcache.tune.probe import greedy

    eos = [t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} if t is not None]
    read = [p.plain() for p in prompts] if full else prompts  # a full prefill reads no link tokens
    out = greedy(model, read, full=full, max_new_tokens=32, eos_ids=eos, batch=batch)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in out]


def probe(model, tokenizer, prompts: list[Laid], who: str, batch: int, passages: list[Passage],
          metrics: dict[str, object]) -> dict[str, list[str]]:
    """`who`'s answers with full prefill and with modules encoded on their own ("who/full", "who/none"),
    and its ordinary-text loss and the seconds it took into `metrics`."""
    device = next(model.parameters()).device
    t = time.perf_counter()
    answers = {}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_autocast(device)):
        if prompts:
            answers[f"{who}/full"] = answer_all(model, tokenizer, prompts, True, batch)
            answers[f"{who}/none"] = answer_all(model, tokenizer, prompts, False, batch)
        metrics[f"{who}_text_loss"] = text_loss(model, tokenizer, passages, device)
    metrics[f"{who}_probe_seconds"] = time.perf_counter() - t
    return answers


@torch.no_grad()
def text_loss(model, tokenizer, passages: list[Passage], device: torch.device) -> float:
    """Mean next-token loss over held-out passages read plainly (no prompt, causal)."""
    total, count = 0.0, 0
    for p in passages:
        ids = torch.tensor([tokenizer.encode(p.text, add_special_tokens=False)[:512]], device=device)
        if ids.shape[1] < 8:
            continue
        logits = model(input_ids=ids).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return total / max(count, 1)


def peak_memory_gb(device: torch.device) -> float:
    """The run's peak memory: the GPU's allocations on CUDA, else the process's resident set (Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(prog="python -m rag_promptcache.tune.recipe")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seconds", type=float, default=5700.0)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--mode", default="shared_prefix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k-max", type=int, default=10, help="most modules in a training prompt")
    ap.add_argument("--k-min", type=int, default=1, help="fewest modules in a training prompt")
    ap.add_argument("--links", type=int, default=0, help="link tokens after each module (0: none)")
    ap.add_argument("--wrap", type=int, default=0,
                    help="wrapper tokens before and after every module, encoded with it (0: none)")
    ap.add_argument("--freeze-lora", action="store_true",
                    help="train the --links or --wrap tokens alone; the LoRA stays as --init left it")
    ap.add_argument("--init", default="", help="an adapter directory to start from (same rank and projections)")
    ap.add_argument("--neighbours", type=int, default=0,
                    help="lay each module out after its M nearest passages, as a corpus ingested with --neighbours M "
                         "encodes it (0: every module on its own)")
    ap.add_argument("--neighbours-present", type=int, default=0,
                    help="a module reads its layout after its neighbours only where this many of them are among the "
                         "prompt's modules, its own encoding otherwise, as a corpus ingested with --neighbours-present "
                         "serves it (0: always); prompts then gather each asked passage's nearest, as retrieval does")
    ap.add_argument("--max-len", type=int,
                    help="longer samples are dropped, hidden neighbour copies counted (default: 3072 times M + 1)")
    ap.add_argument("--neighbours-file", type=Path,
                    help="the passages' neighbour lists: read where the file holds them, else computed and written")
    ap.add_argument("--families", default=",".join(FAMILIES), help="text families to train on")
    ap.add_argument("--fact-share", type=float, default=0.45, help="samples asking a fact where one can be asked")
    ap.add_argument("--full-share", type=float, default=0.15, help="samples the student reads with full attention")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--passages", type=Path)
    ap.add_argument("--write-passages", type=Path)
    ap.add_argument("--probe", type=Path)
    ap.add_argument("--probe-limit", type=int, default=0)
    ap.add_argument("--probe-batch", type=int, default=16)
    args = ap.parse_args(argv)
    from rag_promptcache.model.loading import load_model, model_fingerprint

    if args.write_passages:
        from rag_promptcache.rag.corpus import DEFAULT_INSTRUCTIONS

        write_passages(args.write_passages, DEFAULT_INSTRUCTIONS)
        print(f"passages written to {args.write_passages}", file=sys.stderr)
        return {}
    if args.out is None:
        ap.error("--out is required (where the adapter goes)")
    if not 0 <= args.neighbours_present <= args.neighbours:
        ap.error(f"--neighbours-present must be 0..--neighbours ({args.neighbours}), got {args.neighbours_present}")
    if args.freeze_lora and not (args.links or args.wrap):
        ap.error("--freeze-lora trains the --links or --wrap tokens alone: give one of them")
    t_start = time.perf_counter()
    if args.passages:
        instructions, passages = read_passages(args.passages)
    else:
        from rag_promptcache.rag.corpus import DEFAULT_INSTRUCTIONS

        instructions, passages = DEFAULT_INSTRUCTIONS, gather(tuple(f for f in args.families.split(",") if f))
    train_passages = [p for p in passages if not held_out(p.source)]
    check_passages = [p for p in passages if held_out(p.source) and p.family != "changelog"][:60]
    model, tokenizer = load_model(args.model, device=args.device, dtype="float32", adapter="none")
    device = next(model.parameters()).device
    base_fingerprint = model_fingerprint(model)
    layouter = Layouter(tokenizer, args.mode)
    rows = read_json(args.probe) if args.probe else []
    if args.probe_limit:
        rows = rows[: args.probe_limit]
    prompts = probe_prompts(rows, layouter)
    answers: dict[str, list[str]] = {}
    metrics: dict[str, object] = {}
    answers.update(probe(model, tokenizer, prompts, "base", args.probe_batch, check_passages, metrics))
    args.out.mkdir(parents=True, exist_ok=True)
    if answers:  # written now too, so a run that fails later keeps the base model's answers
        (args.out / "probe_answers.json").write_text(json.dumps(answers))
    print(f"base probed in {metrics['base_probe_seconds']:.0f}s, text loss {metrics['base_text_loss']:.4f}",
          file=sys.stderr, flush=True)
    look_alikes = shared_fact_neighbors(train_passages, seed=args.seed)
    near = None
    if args.neighbours:
        wide = max(args.neighbours, args.k_max) if args.neighbours_present else args.neighbours
        nearest = nearest_passages(train_passages, wide, args.neighbours_file)
        near = [n[len(n) - args.neighbours:] for n in nearest]  # what each module is encoded after
        if args.neighbours_present:  # a question's prompt holds its passage's nearest: the rule then applies
            look_alikes = {i: [*n[::-1], *(j for j in look_alikes.get(i, ()) if j not in n)]
                           for i, n in enumerate(nearest)}
    maker = SampleMaker(train_passages, instructions, k=(args.k_min, args.k_max), seed=args.seed,
                        neighbors=look_alikes, fact_share=args.fact_share)
    cfg = TuneConfig(rank=args.rank, alpha=2 * args.rank, lr=args.lr, max_steps=args.steps, max_seconds=args.seconds,
                     tokens_per_batch=args.tokens_per_batch, seed=args.seed, links=args.links, init=args.init,
                     full_share=args.full_share, wrap=args.wrap, freeze_lora=args.freeze_lora,
                     max_len=args.max_len or max_len_for(args.neighbours))
    vocab = model.get_input_embeddings().weight.shape[0]  # learned ids follow the vocabulary (model/links.py)
    w = args.wrap  # the table: w opening wrappers, w closing ones, then the links
    wrap = (tuple(range(vocab, vocab + w)), tuple(range(vocab + w, vocab + 2 * w)))
    link_ids = tuple(range(vocab + 2 * w, vocab + 2 * w + args.links))
    pool = None
    if args.workers:
        pool = mp.get_context("fork").Pool(args.workers, _init,
                                           (maker, tokenizer, args.mode, link_ids, wrap, near, args.neighbours_present))

        def stream(start: int):
            # windows of 256, the next one laid out while this one trains; never `imap` over an endless
            # iterator, whose feeder thread queues tasks without bound and starves the training loop
            ahead = pool.map_async(_lay, range(start, start + 256), chunksize=8)
            while True:
                start += 256
                window, ahead = ahead.get(), pool.map_async(_lay, range(start, start + 256), chunksize=8)
                yield from window
    else:
        _init(maker, tokenizer, args.mode, link_ids, wrap, near, args.neighbours_present)

        def stream(start: int):
            return map(_lay, itertools.count(start))

    def report(state, terms):
        if state.step % 10 == 0 or state.step == 1:
            print(f"step {state.step} samples {state.samples} {state.seconds:.0f}s kl {terms['kl']:.4f} ce {terms['ce']:.3f} "
                  f"lr {terms['lr']:.2e} tokens {terms['tokens']}", file=sys.stderr, flush=True)

    peft_model, state = train(model, stream, args.out, cfg, report)
    if pool is not None:
        pool.terminate()
    answers.update(probe(peft_model, tokenizer, prompts, "tuned", args.probe_batch, check_passages, metrics))
    metrics.update(steps=state.step, samples=state.samples,
                   train_seconds=state.seconds, total_seconds=time.perf_counter() - t_start,
                   peak_memory_gb=peak_memory_gb(device))
    if answers:
        (args.out / "probe_answers.json").write_text(json.dumps(answers))
    meta = {"format": FORMAT, "base_model": args.model, "base_fingerprint": base_fingerprint, "mode": args.mode,
            "recovery": f"links:{args.links}" if args.links else "none",
            "recipe": {**asdict(cfg), "passages": len(train_passages), "families": args.families,
                       "k": [args.k_min, args.k_max], "fact_share": args.fact_share, "neighbours": args.neighbours,
                       "neighbours_present": args.neighbours_present, "device": device.type}, "metrics": metrics}
    (args.out / "tune.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(metrics), flush=True)
    return meta


if __name__ == "__main__":
    main()
