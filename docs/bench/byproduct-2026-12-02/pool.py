"""Pools the by-product probe's two draws per setting, split and k: retained and kept against the base
model's full prefill (the references the runs name), over both draws' questions; writes pooled.json and
prints the table of docs/FIDELITY.md ("the full prefill's KV as a by-product encoding")."""

import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
DRAWS = {0: ("bench", "bench-k8-12", "heldout-manuals"), 1: ("draw1",)}
SETTINGS = ("none", "nbr:3+none", "byp+none", "last:1", "byp+last:1")
cells: dict[tuple[str, str, int], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])  # ref right, right, both, draws
for draw, dirs in DRAWS.items():
    for d in dirs:
        path = HERE / d / "fidelity.json"
        if not path.exists():
            continue
        for row in json.loads(path.read_text())["rows"]:
            cell = cells[(row["recovery"], row["split"], row["k"])]
            answers = row["answers"]
            cell[0] += sum(a["reference_right"] for a in answers)
            cell[1] += sum(a["cached_right"] for a in answers)
            cell[2] += sum(a["reference_right"] and a["cached_right"] for a in answers)
            cell[3] += 1
out = {}
for setting in SETTINGS:
    shown = []
    for split in ("bench", "heldout", "manuals"):
        for k in (4, 8, 12):
            ref, right, both, draws = cells[(setting, split, k)]
            if not ref:
                shown.append("not run")
                continue
            retained, kept = right / ref, both / ref
            meets = retained >= 0.95 and kept >= 0.90
            shown.append(f"{retained:.2f} / {kept:.2f}" + ("" if meets else " (fails)") + ("" if draws == 2 else f" ({draws} draw)"))
            out[f"{setting} {split} {k}"] = {"reference_right": ref, "right": right, "both_right": both, "draws": draws,
                                             "retained": retained, "kept": kept, "meets": meets}
    print(f"| {setting} | " + " | ".join(shown) + " |")
(HERE / "pooled.json").write_text(json.dumps(out, indent=1) + "\n")
