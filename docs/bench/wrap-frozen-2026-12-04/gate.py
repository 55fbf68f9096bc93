"""Would a per-prompt choice between `none` and `last:1` keep more answers than either, with the 704-sample
wrappers? Joins the wrapped runs' per-question answers (wrapped/: both draws, every split, k = 4, 8, 12) with
each prompt's similarity from the pick probe (docs/bench/pick-2026-12-03/similarity.json: same draws, splits,
k and questions), no model forward: `python3 docs/bench/wrap-frozen-2026-12-04/gate.py`. Prints, per split
and k, kept of the base model's right answers under `none`, `last:1`, an oracle that takes whichever keeps the
answer, and both; then, for each similarity (`pair`, `near`, `near_max`) and direction, the gate whose
threshold keeps the most on bench (the worst k), applied to every split (docs/FIDELITY.md, 2026-12-04 (later))."""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {0: ("manuals0", "manuals0-last1", "both0", "both0-last1"), 1: ("manuals1", "both1")}
SPLITS, KS = ("bench", "heldout", "manuals"), (4, 8, 12)


def load(path: Path):
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


similarity = {(s["draw"], s["split"], s["k"], s["question"]): s
              for s in load(HERE.parent / "pick-2026-12-03" / "similarity.json")}
answers: dict[tuple, dict] = {}
for draw, runs in RUNS.items():
    for run in runs:
        for row in load(HERE / "wrapped" / run / "fidelity.json.gz")["rows"]:
            for a in row["answers"]:
                answers.setdefault((draw, row["split"], row["k"], a["question"]), {})[row["recovery"]] = a


def prompts(split: str, k: int):
    """The prompts of a split and k whose question the base model's full prefill answers right."""
    return [(key, a) for key, a in answers.items() if key[1:3] == (split, k) and a["none"]["reference_right"]]


def gated(feature: str, threshold: float, below: bool, split: str, k: int) -> tuple[int, int]:
    chosen = prompts(split, k)
    keep = sum(a["none" if (similarity[key][feature] < threshold) == below else "last:1"]["cached_right"]
               for key, a in chosen)
    return keep, len(chosen)


print("split k: of | none last:1 either both")
for split in SPLITS:
    for k in KS:
        chosen = [a for _, a in prompts(split, k)]
        n, last = ([a[s]["cached_right"] for a in chosen] for s in ("none", "last:1"))
        print(f"{split} {k}: {len(chosen)} | {sum(n)} {sum(last)} {sum(x or y for x, y in zip(n, last))} "
              f"{sum(x and y for x, y in zip(n, last))}")
for feature in ("pair", "near", "near_max"):
    for below in (True, False):
        mine = sorted({s[feature] for s in similarity.values()})
        candidates = [mine[i * len(mine) // 40] for i in range(40)] + [2.0]
        best = max(candidates, key=lambda t: min(keep / of for keep, of in (gated(feature, t, below, "bench", k)
                                                                            for k in KS)))
        cells = " ".join("%d/%d" % gated(feature, best, below, s, k) for s in SPLITS for k in KS)
        print(f"none where {feature} {'<' if below else '>='} {best:.3f}: {cells}")
