"""The shipped LoRA at other strengths on manuals (draws 0 and 1, k = 4 and 8, `last:1`): kept of the base model's
full-prefill right answers by the cached answers and by the scaled model's own full prefill, pooled over the draws.
Strength 1 is the shipped adapter's runs the front was judged on (reference-2026-12-04/rejudged/shipped), 0 the
base model (`--adapter none`). No model run; from the repository root:
python3 docs/bench/lora-scale-2026-12-05/table.py > docs/bench/lora-scale-2026-12-05/table.md
"""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).parent
SHIPPED = HERE.parent / "reference-2026-12-04/rejudged/shipped"
RUNS = {"0 (base model)": "m{}-base", "0.5 (lora_alpha 16)": "m{}-a050", "0.75 (lora_alpha 24)": "m{}-a075"}


def rows(folder: Path) -> list[dict]:
    return json.loads(gzip.decompress((folder / "fidelity.json.gz").read_bytes()))["rows"]


def cell(strength: str, k: int) -> str:
    folders = [SHIPPED / f"manuals{d}" for d in (0, 1)] if strength.startswith("1") else \
        [HERE / RUNS[strength].format(d) for d in (0, 1)]
    ref = cached = full = right = 0
    speedups = []
    for folder in folders:
        row = next(r for r in rows(folder) if r["recovery"] == "last:1" and r["k"] == k)
        asked = [a for a in row["answers"] if a["reference_right"]]
        ref += len(asked)
        cached += sum(a["cached_right"] for a in asked)
        full += sum(a["full_right"] for a in asked)
        right += row["cached_correct"]
        speedups.append(row["speedup"])
    return (f"{cached}/{ref} = {cached / ref:.2f} | {full}/{ref} = {full / ref:.2f} | {right / ref:.2f} | "
            f"{min(speedups):.1f}-{max(speedups):.1f}x")


print("| LoRA strength | k | cached `last:1` kept | own full prefill kept | cached retained | speed-up |")
print("|---|---|---|---|---|---|")
for strength in (*RUNS, "1 (shipped, lora_alpha 32)"):
    for k in (4, 8):
        print(f"| {strength} | {k} | {cell(strength, k)} |")
