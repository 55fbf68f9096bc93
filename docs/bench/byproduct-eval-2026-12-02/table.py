import json, glob, os
for f in sorted(glob.glob("docs/bench/byproduct-eval-2026-12-02/*-k*.json")):
    d = json.load(open(f))
    name = os.path.basename(f)[:-5]
    cells = []
    for r in d["settings"]:
        cells.append(f'{r["recovery"]} {r["retained"]:.2f}/{r["kept"]:.2f} ({r["kept_counts"][0]}/{r["kept_counts"][1]}){"*" if r["meets"] else ""}')
    print(name, "full", d["settings"][0]["full_correct"], "/", d["settings"][0]["with_answer"], "| rec", d["recommended"], "|", " | ".join(cells))
