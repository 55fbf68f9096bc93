"""Pools the two draws of the pick probe per setting, split and k: retained and kept against the base model's
full prefill (the references the runs name), over both draws' questions, with each draw's speed-up against
this model's own full prefill (rough: other work shared the machine); writes pooled.json and prints the table
of docs/FIDELITY.md ("... choosing each module's encoding per prompt"). `python pool.py product`: the same for
the product path's runs (`benchmarks.fidelity --neighbours 3 --neighbours-present 2`, product/), into
product/pooled.json. `python pool.py DIR`: every run folder in DIR (a `fidelity.json` in each, or gzipped), into
DIR/pooled.json (docs/bench/nbr-tune-2026-12-03: the adapter trained on the neighbour layout;
docs/bench/wrap-frozen-2026-12-04/wrapped, .../wrapped-nbr and .../shipped: the wrapper run, over a
--neighbours-present corpus, and the shipped adapter beside it)."""

import collections
import gzip
import json
import sys
from pathlib import Path


def saved(run: Path) -> Path | None:
    """A run's fidelity.json or, where the tree keeps it compressed, fidelity.json.gz; None: neither."""
    return next((p for p in (run / "fidelity.json", run / "fidelity.json.gz") if p.exists()), None)


def rows(run: Path) -> list:
    path = saved(run)
    if path is None:
        return []
    text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(text)["rows"]


PRODUCT = sys.argv[1:] == ["product"]
GIVEN = Path(sys.argv[1]) if sys.argv[1:] and not PRODUCT else None
HERE = GIVEN or (Path(__file__).parent / "product" if PRODUCT else Path(__file__).parent)
RUNS = (sorted(d.name for d in GIVEN.iterdir() if saved(d)) if GIVEN
        else ("both0", "manuals0", "both1", "manuals1") if PRODUCT else ("draw0", "draw1"))
cells: dict[tuple[str, str, int], list] = collections.defaultdict(lambda: [0, 0, 0, 0, []])  # ref right, right, both, draws, speed-ups
settings: list[str] = []
for run in RUNS:
    for row in rows(HERE / run):
        name = row["recovery"] if "recovery" in row else row["setting"]
        settings += [name] if name not in settings else []
        cell = cells[(name, row["split"], row["k"])]
        answers = row["answers"]
        cell[0] += sum(a["reference_right"] for a in answers)
        cell[1] += sum(a["cached_right"] for a in answers)
        cell[2] += sum(a["reference_right"] and a["cached_right"] for a in answers)
        cell[3] += 1
        cell[4].append(row["speedup"])
out = {}
print("| setting | " + " | ".join(f"{s} k={k}" for s in ("bench", "heldout", "manuals") for k in (4, 8, 12)) + " |")
print("|---|" + "---|" * 9)
for setting in settings:
    shown = []
    for split in ("bench", "heldout", "manuals"):
        for k in (4, 8, 12):
            ref, right, both, draws, speed = cells[(setting, split, k)]
            if not ref:
                shown.append("not run")
                continue
            retained, kept = right / ref, both / ref
            meets = retained >= 0.95 and kept >= 0.90
            shown.append(f"{retained:.2f} / {kept:.2f}" + ("" if meets else " (fails)")
                         + f" · {min(speed):.1f}" + (f"-{max(speed):.1f}x" if draws == 2 else f"x ({draws} draw)"))
            out[f"{setting} {split} {k}"] = {"reference_right": ref, "right": right, "both_right": both, "draws": draws,
                                             "retained": retained, "kept": kept, "meets": meets, "speedups": speed}
    print(f"| `{setting}` | " + " | ".join(shown) + " |")
(HERE / "pooled.json").write_text(json.dumps(out, indent=1) + "\n")
