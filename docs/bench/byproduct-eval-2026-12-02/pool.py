"""Pool eval --byproduct's two draws: kept counts and right answers summed per split, k and setting."""
import json, sys
from pathlib import Path
here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
order = ["none", "byproduct+none", "last:1", "byproduct+last:1"]
for split in ("bench", "heldout", "manuals"):
    for k in (4, 8, 12):
        cells = []
        for s in order:
            kept = total = full = cached = 0
            for name in (f"{split}-k{k}.json", f"{split}-draw1-k{k}.json"):
                r = {x["recovery"]: x for x in json.load(open(here / name))["settings"]}[s]
                kept += r["kept_counts"][0]; total += r["kept_counts"][1]
                full += r["full_correct"]; cached += r["cached_correct"]
            ret, kp = cached / full, kept / total
            cells.append(f"{s} {ret:.2f}/{kp:.2f} ({kept}/{total}){'' if ret >= 0.95 and kp >= 0.90 else ' (fails)'}")
        print(f"{split} k={k}: " + " | ".join(cells))
