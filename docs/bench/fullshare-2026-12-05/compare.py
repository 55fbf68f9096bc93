"""The adapter fine-tuned with half its samples read with full attention (`--full-share 0.5`) against the
shipped one, on the manuals split's five draws: per k, of the base model's full-prefill right answers, how many
each keeps with `last:1` (the default) and with its own full prefill (no cache), with Wilson 95% intervals and
McNemar's exact p against the shipped default on the same questions. No model run; from the repository root:
    python3 docs/bench/fullshare-2026-12-05/compare.py [RUNS_DIR]
RUNS_DIR holds manuals0..4/fidelity.json(.gz) of the candidate (default: this folder).
"""

import gzip
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from rag_promptcache.rag.fidelity import interval  # noqa: E402

HERE = Path(__file__).parent
SHIPPED = {d: ROOT / f"docs/bench/reference-2026-12-04/rejudged/shipped/manuals{d}" for d in (0, 1)} | {
    d: ROOT / f"docs/bench/manuals-draws-2026-12-04/shipped{d}" for d in (2, 3, 4)}


def load(folder: Path) -> dict:
    for name in ("fidelity.json.gz", "fidelity.json"):
        if (folder / name).exists():
            data = (folder / name).read_bytes()
            return json.loads(gzip.decompress(data) if name.endswith(".gz") else data)
    raise FileNotFoundError(folder)


def answers(folder: Path, k: int, full: bool) -> dict[str, tuple[bool, bool]]:
    row = next(r for r in load(folder)["rows"] if r["recovery"] == "last:1" and r["k"] == k)
    return {a["question"]: (a["reference_right"], a["full_right" if full else "cached_right"]) for a in row["answers"]}


def mcnemar(b: int, c: int) -> float:
    n = b + c
    return 1.0 if not n else min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n)


def main() -> None:
    runs = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    draws = [d for d in range(5) if any((runs / f"manuals{d}" / n).exists() for n in ("fidelity.json", "fidelity.json.gz"))]
    print(f"manuals, draws {draws}: kept of the base model's full-prefill right answers\n")
    print("| k | setting | kept (95% interval) | against the shipped default: kept where it lost / lost where it kept (p) |")
    print("|---|---|---|---|")
    for k in (4, 8, 12):
        base = {}
        for d in draws:
            base |= {f"{d}:{q}": v for q, v in answers(SHIPPED[d], k, False).items()}
        for label, folder, full in (("shipped `last:1` (default)", None, False), ("shipped, own full prefill", None, True),
                                    ("full-share 0.5 `last:1`", runs, False), ("full-share 0.5, own full prefill", runs, True)):
            got = {}
            for d in draws:
                got |= {f"{d}:{q}": v for q, v in answers(folder / f"manuals{d}" if folder else SHIPPED[d], k, full).items()}
            assert got.keys() == base.keys()
            right = [q for q, (ref, _) in base.items() if ref]
            assert all(got[q][0] for q in right)  # the same reference
            kept = sum(got[q][1] for q in right)
            lo, hi = interval(kept, len(right))
            b = sum(got[q][1] and not base[q][1] for q in right)
            c = sum(base[q][1] and not got[q][1] for q in right)
            vs = "-" if label.startswith("shipped `last:1`") else f"{b} / {c} ({mcnemar(b, c):.2f})"
            print(f"| {k} | {label} | {kept}/{len(right)} = {kept / len(right):.2f} ({lo:.2f}-{hi:.2f}) | {vs} |")


if __name__ == "__main__":
    main()
