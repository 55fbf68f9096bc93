"""Pools the two draws' codec rows per codec, split and k: retained and kept against fp16 modules over both
draws' questions. draw0/, draw1/: the default recovery (`last:1`); none0/, none1/: `--codec-recovery none`
(every module read from the store). Writes pooled.json and prints the tables of docs/stores.md."""

import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
out = {}
for label, dirs, codecs in (("last:1", ("draw0", "draw1"), ("int8", "k6v6", "k7v5", "k5v5")),
                            ("none", ("none0", "none1"), ("int8", "k6v6"))):
    runs = [json.loads((HERE / d / "fidelity.json").read_text()) for d in dirs]
    cells: dict[tuple[str, str, int], list] = collections.defaultdict(lambda: [0, 0, 0, []])  # fp16 right, codec right, both, bytes
    for run in runs:
        for row in run["codec_rows"]:
            if row["codec"] != "fp16":
                cell = cells[(row["codec"], row["split"], row["k"])]
                cell[0] += row["full_correct"]
                cell[1] += row["cached_correct"]
                cell[2] += row["kept_counts"][0]
                cell[3].append(row["bytes_per_token"])
    print(f"recovery {label}")
    for codec in codecs:
        shown, sizes = [], []
        for split in ("bench", "heldout", "manuals"):
            for k in (4, 8, 12):
                fp16, right, both, size = cells[(codec, split, k)]
                sizes += size
                retained, kept = right / fp16, both / fp16
                meets = retained >= 0.95 and kept >= 0.90
                shown.append(f"{retained:.2f} / {kept:.2f}" + ("" if meets else " (fails)"))
                out[f"{label} {codec} {split} {k}"] = {"fp16_right": fp16, "codec_right": right, "both_right": both,
                                                       "retained": retained, "kept": kept, "meets": meets}
        print(f"| {codec} | {min(sizes):,.0f}-{max(sizes):,.0f} | " + " | ".join(shown) + " |")
(HERE / "pooled.json").write_text(json.dumps(out, indent=1) + "\n")
