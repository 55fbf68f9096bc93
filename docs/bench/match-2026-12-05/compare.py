"""`match:T` against the default (`last:1`) and `none`, question by question: kept of the base model's full-prefill
right answers per split, draw and k, pooled, with each run's speed-up, and McNemar's exact p against the default on
the same questions. The shipped rows come from the runs the front was judged on (reference-2026-12-04/rejudged for
draws 0-1, manuals-draws-2026-12-04 for manuals draws 2-4); the match rows from this folder's runs, judged against
the same references. No model run; from the repository root:
python3 docs/bench/match-2026-12-05/compare.py
"""

import gzip
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).parent
REJUDGED = ROOT / "docs/bench/reference-2026-12-04/rejudged/shipped"
DRAWS = ROOT / "docs/bench/manuals-draws-2026-12-04"


def load(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def first(folder: Path) -> Path | None:
    return next((p for p in (folder / "fidelity.json.gz", folder / "fidelity.json") if p.exists()), None)


def shipped_run(split: str, draw: int) -> Path:
    if split == "manuals":
        return first(REJUDGED / f"manuals{draw}") if draw < 2 else first(DRAWS / f"shipped{draw}")
    return first(REJUDGED / f"both{draw}")


def row(run: Path, split: str, setting: str, k: int) -> dict | None:
    return next((r for r in load(run)["rows"] if r["split"] == split and r["recovery"] == setting and r["k"] == k), None)


def mcnemar(b: int, c: int) -> float:
    n = b + c
    return 1.0 if not n else min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n)


def main(settings: list[str]) -> None:
    pooled: dict[tuple, dict] = {}
    for folder in sorted(p for p in HERE.iterdir() if p.is_dir()):
        run = first(folder)
        if run is None:
            continue
        data = load(run)
        draw = data["seed_offset"]
        for split in data["splits"]:
            for k in sorted({r["k"] for r in data["rows"] if r["split"] == split}):
                base = shipped_run(split, draw)
                default = row(base, split, "last:1", k)
                for setting in settings:
                    own = row(run, split, setting, k) if setting.startswith("match") else row(base, split, setting, k)
                    if own is None or default is None:
                        continue
                    assert [a["question"] for a in own["answers"]] == [a["question"] for a in default["answers"]]
                    pairs = [(a["reference_right"], a["cached_right"], d["cached_right"])
                             for a, d in zip(own["answers"], default["answers"])]
                    kept = sum(r and c for r, c, _ in pairs)
                    right = sum(r for r, _, _ in pairs)
                    won = sum(r and c and not d for r, c, d in pairs)
                    lost = sum(r and d and not c for r, c, d in pairs)
                    # a shipped row is read again by every run of its draw: counted once
                    pooled.setdefault((split, k, setting), {})[draw] = (kept, right, won, lost, own["speedup"])
    print("| split | draw | k | setting | kept | speed-up | kept where the default lost / lost where it kept |")
    print("|---|---|---|---|---|---|---|")
    for (split, k, setting), by_draw in sorted(pooled.items()):
        for draw, (kept, right, won, lost, speedup) in sorted(by_draw.items()):
            print(f"| {split} | {draw} | {k} | `{setting}` | {kept}/{right} = {kept / right:.2f} | {speedup:.1f}x | "
                  f"{won} / {lost} |")
    print("\n| split | k | setting | draws | kept, pooled | speed-up | against the default (McNemar p) |")
    print("|---|---|---|---|---|---|---|")
    for (split, k, setting), by_draw in sorted(pooled.items()):
        runs = list(by_draw.values())
        kept, right, won, lost = (sum(r[i] for r in runs) for i in range(4))
        speeds = [r[4] for r in runs]
        print(f"| {split} | {k} | `{setting}` | {len(runs)} | {kept}/{right} = {kept / right:.2f} | "
              f"{min(speeds):.1f}-{max(speeds):.1f}x | {won} / {lost} (p {mcnemar(won, lost):.2f}) |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["match:32", "match:32@16", "match:32@32", "last:1", "none"])
