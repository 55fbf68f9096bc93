"""`rag-promptcache tune` measured on a corpus it has never seen: the real CLI in a child process, on a
corpus of one of the fidelity splits' documents encoded by the default model, with a time budget.

    python -m research.tune_run --split heldout --minutes 20 --out docs/bench/tune-DATE

Writes tune_run.json and tune_run.md into `--out`: wall time of the build and of the tune, the child's
peak resident memory, steps and samples, and the command's own check (questions it makes from held-out
modules or, with `--split-questions`, the split's own questions as a user's `--questions` file, asked
before and after with full prefill and with modules encoded on their own, `kept` against the base
model's full prefill) and verdict. The corpus is built with the base model (`--adapter none`), as a
user's first corpus would be before any tuning.

Not here: the default model's recipe (`tune/recipe.py`), the fidelity benchmark (`fidelity.py`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rag_promptcache.bench.fidelity import SPLITS, split_data


def run(split: str, minutes: float, check: int, draw: int, workdir: Path, split_questions: bool = False) -> dict[str, object]:
    from rag_promptcache.rag import Corpus

    data, chunk_tokens = split_data(split, seed_offset=draw)
    t0 = time.perf_counter()
    corpus = Corpus.build(data.documents, workdir / "corpus", adapter="none", progress=False, chunk_tokens=chunk_tokens)
    modules = len(corpus.table.modules())
    corpus.close()
    built = time.perf_counter() - t0
    asked = []
    if split_questions:
        (workdir / "questions.jsonl").write_text("".join(
            json.dumps({"question": q.question, "answer": q.answer}) + "\n" for q in data.questions))
        asked = ["--questions", str(workdir / "questions.jsonl")]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rag_promptcache.cli", "tune", "-c", str(workdir / "corpus"),
                           "--minutes", str(minutes), "--check", str(check), *asked, "--json"],
                          capture_output=True, text=True)
    tuned = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"tune exited {proc.returncode}: {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"split": split, "draw": draw, "documents": len(data.documents), "modules": modules, "minutes": minutes,
            "build_seconds": built, "tune_seconds": tuned,
            "peak_memory_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, **report}


def markdown(r: dict[str, object]) -> str:
    lines = [f"# `rag-promptcache tune` on the {r['split']} split's documents (draw {r['draw']})", "",
             f"{r['documents']} documents, {r['modules']} modules; build {r['build_seconds']:.0f} s; tune "
             f"{r['tune_seconds']:.0f} s wall (budget {r['minutes']} min of training), {r['steps']} steps, "
             f"{r['samples']} samples; peak memory {r['peak_memory_gb']:.1f} GiB.", ""]
    check = r.get("check")
    if check:
        kinds = ", ".join(f"{n} {kind}" for kind, n in check.get("kinds", {}).items())
        lines += [f"Check questions: {kinds or check['questions']}.", ""]
        lines += ["| setting | right | kept |", "|---|---|---|"]
        for s, right in check["right"].items():
            kept = check["kept"].get(s)
            lines.append(f"| {s} | {right}/{check['questions']} | {'' if kept is None else f'{kept:.2f}'} |")
        lines.append("")
    lines.append(f"Verdict: {'applied' if r['applied'] else 'not applied'} ({r['reason']}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=SPLITS, default="heldout")
    ap.add_argument("--draw", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--check", type=int, default=24)
    ap.add_argument("--split-questions", action="store_true", help="check on the split's own questions")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.split, args.minutes, args.check, args.draw, Path(tmp), args.split_questions)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_run.json").write_text(json.dumps(result, indent=1))
    (args.out / "tune_run.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
