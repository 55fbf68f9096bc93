"""How far the rule's measure moves when nothing but the float order changes, and the front against today's
references. From the repository root, no model runs:

    python3 docs/bench/reference-2026-12-04/floor.py

Prints two tables of docs/FIDELITY.md ("2026-12-04 (night)"):
1. per split and k, both draws pooled: the base model's full-prefill right answers in the new references (refs/:
   bf16, two threads, today's prompts), in the old ones (25-27 Nov, other prompts), and in the same full prefill
   run with one thread (floor/bf16-t1/: only the order of the bf16 sums differs), with the paired kept of the
   reference's right answers for each;
2. the tuned model's own full prefill judged the same way (the shipped runs of 4 Dec, rejudged/shipped/).
"""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).parent
OLD = {("both", 0): "docs/bench/fidelity-quiet-2026-11-25/tokens32/fidelity.json",
       ("both", 1): "docs/bench/fidelity-quiet-2026-11-25/seed1-tokens32/fidelity.json",
       ("manuals", 0): "docs/bench/fidelity-manuals-2026-11-26/fidelity.json",
       ("manuals", 1): "docs/bench/fidelity-manuals-2026-11-27-draw1/fidelity.json"}


def load(path: Path) -> dict:
    path = path if path.exists() else path.with_name(path.name + ".gz")
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes())


def row(doc: dict, split: str, k: int) -> dict:
    return next(r for r in doc["rows"] if r["split"] == split and r["k"] == k)


def right(doc: dict, split: str, k: int, key: str = "full_right") -> dict[str, bool]:
    return {a["question"]: bool(a[key]) for a in row(doc, split, k)["answers"]}


def main() -> None:
    print("| split | k | new reference: right (context tokens) | old reference: right · kept (context tokens) | "
          "one thread: right · kept | tuned model's full prefill: right · kept |")
    print("|---|---|---|---|---|---|")
    for split in ("bench", "heldout", "manuals"):
        group = "manuals" if split == "manuals" else "both"
        for k in (4, 8, 12):
            n = {"ref": 0, "ctx": [], "old": 0, "old_kept": 0, "old_ctx": [], "t1": 0, "t1_kept": 0, "own": 0, "own_kept": 0}
            for d in (0, 1):
                ref_doc = load(HERE / "refs" / f"{group}{d}" / "fidelity.json")
                ref = right(ref_doc, split, k)
                n["ref"] += sum(ref.values())
                n["ctx"].append(row(ref_doc, split, k)["context_tokens"])
                old_doc = load(Path(OLD[group, d]))
                old = right(old_doc, split, k)
                n["old"] += sum(old.values())
                n["old_kept"] += sum(ref[q] and old[q] for q in ref)
                n["old_ctx"].append(row(old_doc, split, k)["context_tokens"])
                t1 = right(load(HERE / "floor" / "bf16-t1" / f"{group}{d}" / "fidelity.json"), split, k)
                n["t1"] += sum(t1.values())
                n["t1_kept"] += sum(ref[q] and t1[q] for q in ref)
                own_doc = load(HERE / "rejudged" / "shipped" / f"{group}{d}" / "fidelity.json")
                own = right(own_doc, split, k)  # the tuned model's full prefill, in the rejudged shipped run
                n["own"] += sum(own.values())
                n["own_kept"] += sum(ref[q] and own[q] for q in ref)
            share = lambda key: f"{n[key + '_kept']}/{n['ref']} ({n[key + '_kept'] / n['ref']:.2f})"  # noqa: E731
            ctx = lambda key: "-".join(f"{c:.0f}" for c in n[key])  # noqa: E731
            print(f"| {split} | {k} | {n['ref']} ({ctx('ctx')}) | {n['old']} · {share('old')} ({ctx('old_ctx')}) | "
                  f"{n['t1']} · {share('t1')} | {n['own']} · {share('own')} |")


if __name__ == "__main__":
    main()
