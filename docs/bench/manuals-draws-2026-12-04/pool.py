"""The manuals split over five draws (seed offsets 0-4): the default (the shipped adapter, `last:1`) and the
neighbour corpus (`--neighbours 3 --neighbours-present 2`) read with `none` and `last:1`, each judged against the
base model's full prefill of the same prompts. Per setting and k: kept (paired) with its 95% Wilson interval,
over two draws (the rule's), over all five and per draw, the tuned model's own full prefill (no cache) as a row
of its own; then each setting against the default on the same questions (the
base model's right answers one keeps and the other loses, and McNemar's exact two-sided p). No model run;
from the repository root: python3 docs/bench/manuals-draws-2026-12-04/pool.py
"""

import functools
import gzip
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from rag_promptcache.rag.fidelity import interval  # noqa: E402

HERE = Path(__file__).parent
REJUDGED = ROOT / "docs/bench/reference-2026-12-04/rejudged"
# (label, folder of draws 0 and 1 (rejudged against the references of 4 Dec), folder prefix of draws 2-4, setting)
SETTINGS = [
    ("default (`last:1`)", REJUDGED / "shipped", "shipped", "last:1"),
    ("shipped `none`", REJUDGED / "shipped", "shipped", "none"),
    ("neighbour corpus `none`", REJUDGED / "neighbours", "nbr", "none"),
    ("neighbour corpus `last:1`", REJUDGED / "neighbours", "nbr", "last:1"),
    ("the tuned model's own full prefill", REJUDGED / "shipped", "shipped", "full"),
]


@functools.cache  # each run is read by several settings and every k
def load(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def answers(label_dir: Path, prefix: str, setting: str, draw: int, k: int) -> list[tuple[str, bool, bool]]:
    """[(question, the base model's full prefill right, the setting's cached answer right)] of one draw; setting
    "full": the tuned model's own full prefill in that run, in place of a cached answer"""
    run = label_dir / f"manuals{draw}" / "fidelity.json.gz" if draw < 2 else HERE / f"{prefix}{draw}" / "fidelity.json.gz"
    full = setting == "full"
    setting = "last:1" if full else setting
    row = next(r for r in load(run)["rows"] if r["split"] == "manuals" and r["recovery"] == setting and r["k"] == k)
    return [(f"{draw}:{a['question']}", a["reference_right"], a["full_right" if full else "cached_right"])
            for a in row["answers"]]


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided p of b against c discordant pairs (binomial at 1/2)."""
    n = b + c
    if not n:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def main() -> None:
    draws = [d for d in range(5) if d < 2 or (HERE / f"shipped{d}").exists()]
    print(f"manuals, draws {draws}; kept of the base model's full-prefill right answers (95% Wilson interval)\n")
    print("| setting | k | two draws (0, 1) | all draws | each draw | against the default: kept where it lost / "
          "lost where it kept (p) |")
    print("|---|---|---|---|---|---|")
    for k in (4, 8, 12):
        base = {q: (ref, right) for d in draws for q, ref, right in answers(*SETTINGS[0][1:], d, k)}
        for label, folder, prefix, setting in SETTINGS:
            rows = [a for d in draws for a in answers(folder, prefix, setting, d, k)]
            cells = []
            for subset in ([a for a in rows if a[0][0] in "01"], rows):
                ref = [a for a in subset if a[1]]
                kept = sum(a[2] for a in ref)
                lo, hi = interval(kept, len(ref))
                cells.append(f"{kept}/{len(ref)} = {kept / len(ref):.2f} ({lo:.2f}-{hi:.2f})")
            gained = sum(1 for q, ref, right in rows if ref and right and not base[q][1])
            lost = sum(1 for q, ref, right in rows if ref and not right and base[q][1])
            versus = "-" if label == SETTINGS[0][0] else f"{gained} / {lost} (p {mcnemar(gained, lost):.2f})"
            per_draw = " ".join(f"{sum(a[2] for a in rows if a[1] and a[0].startswith(f'{d}:'))}/"
                                f"{sum(a[1] for a in rows if a[0].startswith(f'{d}:'))}" for d in draws)
            print(f"| {label} | {k} | {cells[0]} | {cells[1]} | {per_draw} | {versus} |")


if __name__ == "__main__":
    main()
