"""Pools the draws of the wrapper run per adapter, setting, split and k: retained and kept against the base
model's full prefill (the references the runs name), over every draw's questions, with each draw's speed-up
against that adapter's own full prefill. `wrapped/` holds the runs of the shipped LoRA with 8 + 8 wrapper
tokens trained on it (frozen), `shipped/` the shipped adapter's on the same prompts; writes pooled.json and
prints the table of docs/FIDELITY.md ("wrapper tokens on the frozen LoRA")."""

import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
cells: dict[tuple[str, str, int], list] = collections.defaultdict(lambda: [0, 0, 0, 0, []])  # ref right, right, both, draws, speed-ups
settings: list[str] = []
for adapter in ("shipped", "wrapped"):
    for path in sorted((HERE / adapter).glob("*/fidelity.json")):
        for row in json.loads(path.read_text())["rows"]:
            name = f"{adapter} {row['recovery']}"
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
                         + f" · {min(speed):.1f}" + (f"-{max(speed):.1f}x" if draws > 1 else "x (1 draw)"))
            out[f"{setting} {split} {k}"] = {"reference_right": ref, "right": right, "both_right": both, "draws": draws,
                                             "retained": retained, "kept": kept, "meets": meets, "speedups": speed}
    print(f"| `{setting}` | " + " | ".join(shown) + " |")
(HERE / "pooled.json").write_text(json.dumps(out, indent=1) + "\n")
