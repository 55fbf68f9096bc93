"""The front judged against today's references (docs/FIDELITY.md, "2026-12-04 (night)"): kept (paired, of the
base model's full-prefill right answers) against the speed-up over each setting's own full prefill, per split
and k, for every setting of 2-4 Dec rejudged by rejudge.sh (two draws pooled unless a label says otherwise), the
probes of 5 Dec, which were judged against the same references when they ran (draws 0 and 1 pooled from their
runs: `RUNS`), the untuned model's `none` (base-pooled/, the references' own rows) and the default drawn bold.
The rule's kept line is 0.90. No model runs; from the repository root:
    .venv/bin/python docs/bench/reference-2026-12-04/front.py
"""

import gzip
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

HERE = Path(__file__).parent
BENCH = HERE.parent
SPLITS = ("bench", "heldout", "manuals")
DEFAULT = "shipped `last:1` (the default)"
# (family folder under rejudged/, setting, label); the pick probe's own `none` and `last:1` are the shipped rows'
LINES = [
    ("shipped", "last:1", DEFAULT),
    ("shipped", "none", "shipped `none`"),
    ("neighbours", "none", "neighbour corpus `none`"),
    ("neighbours", "last:1", "neighbour corpus `last:1`"),
    ("wrapped", "none", "wrappers (704) `none`"),
    ("wrapped", "last:1", "wrappers (704) `last:1`"),
    ("wrapped-1088", "none", "wrappers (1,088) `none`"),
    ("wrapped-neighbours", "none", "wrappers, neighbour corpus `none` (1 draw)"),
    ("pick", "pick:2+none", "`pick:2+none` (probe)"),
    ("pick", "pick:1+none", "`pick:1+none` (probe)"),
    ("pick", "pick:2+gate", "`pick:2+gate` (probe)"),
    ("pick", "first_k:2", "`first_k:2` (probe)"),
    ("pick", "first_k:4", "`first_k:4` (probe)"),
]
# the probes of 5 Dec: (label, setting, run folders under docs/bench, draws 0 and 1); some speed-ups were taken
# beside other jobs (docs/FIDELITY.md says which)
RUNS = [
    ("`match:32` (probe; held-out k = 8, 12 one draw)", "match:32",
     ["match-2026-12-05/bench0", "match-2026-12-05/both1", "match-2026-12-05/heldout0",
      "match-2026-12-05/manuals0", "match-2026-12-05/manuals1"]),
    ("`match:32@16` (probe)", "match:32@16",
     [f"match-2026-12-05/head-{split}{draw}" for split in SPLITS for draw in (0, 1)]),
    ("full-share 0.5 `last:1` (probe, manuals)", "last:1", ["fullshare-2026-12-05/manuals0", "fullshare-2026-12-05/manuals1"]),
    ("LoRA at 0.75 `last:1` (probe, manuals)", "last:1", ["lora-scale-2026-12-05/m0-a075", "lora-scale-2026-12-05/m1-a075"]),
    ("untuned `last:1` (probe, manuals)", "last:1", ["lora-scale-2026-12-05/m0-base", "lora-scale-2026-12-05/m1-base"]),
]


def family(name: str, setting: str) -> dict[str, list[tuple[int, float, float]]]:
    """split -> [(k, mean speed-up over the draws, kept)] from a rejudged family's pooled.json"""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for key, cell in json.loads((HERE / "rejudged" / name / "pooled.json").read_text()).items():
        s, split, k = key.rsplit(" ", 2)
        if s == setting:
            out.setdefault(split, []).append((int(k), sum(cell["speedups"]) / len(cell["speedups"]), cell["kept"]))
    return out


def runs(setting: str, folders: list[str]) -> dict[str, list[tuple[int, float, float]]]:
    """split -> [(k, mean speed-up over the runs, kept)] pooled from each run's answers, each judged against its
    draw's reference when it ran (`reference_right`)"""
    kept: dict[tuple[str, int], list[int]] = {}
    speedups: dict[tuple[str, int], list[float]] = {}
    for folder in folders:
        for r in json.loads(gzip.decompress((BENCH / folder / "fidelity.json.gz").read_bytes()))["rows"]:
            if r["recovery"] != setting:
                continue
            asked = [a for a in r["answers"] if a["reference_right"]]
            counts = kept.setdefault((r["split"], r["k"]), [0, 0])
            counts[0] += sum(a["cached_right"] for a in asked)
            counts[1] += len(asked)
            speedups.setdefault((r["split"], r["k"]), []).append(r["speedup"])
    out: dict[str, list[tuple[int, float, float]]] = {}
    for (split, k), (n, of) in kept.items():
        out.setdefault(split, []).append((k, sum(speedups[split, k]) / len(speedups[split, k]), n / of))
    return out


def untuned() -> dict[str, list[tuple[int, float, float]]]:
    """The base model's `none` against its own full prefill (benchmarks.fidelity --pool's rows)"""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for r in json.loads((HERE / "base-pooled" / "both" / "fidelity.json").read_text())["rows"]:
        out.setdefault(r["split"], []).append((r["k"], r["speedup"], r["kept"]))
    return out


def main() -> None:
    fronts = [(label, family(name, setting)) for name, setting, label in LINES]
    fronts += [(label, runs(setting, folders)) for label, setting, folders in RUNS]
    fronts.append(("untuned `none` (bench, held-out)", untuned()))
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("Dark2").colors
    colours = dict(zip([label for label, _ in fronts[1:]], palette))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6), sharey=True)
    for ax, split in zip(axes, SPLITS):
        for label, by_split in fronts:
            points = sorted(by_split.get(split, []))
            if not points:
                continue
            bold = label == DEFAULT
            line, = ax.plot([p[1] for p in points], [p[2] for p in points], marker="o",
                            linewidth=2.6 if bold else 1.0, markersize=6 if bold else 3.5,
                            color="black" if bold else colours[label], linestyle="-" if bold or "probe" not in label else "--",
                            label=label, zorder=3 if bold else 2)
            for k, x, y in points:
                ax.annotate(f"{k}", (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points", color=line.get_color())
        ax.axhline(0.90, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks([2, 4, 8, 16, 32])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0.3, 1.02)
        ax.set_title(split)
        ax.set_xlabel("speed-up over the setting's own full prefill (log)")
    axes[0].set_ylabel("kept (paired, of the base model's full-prefill right answers)")
    handles = {}  # every line once, in the order drawn: some are on manuals only
    for ax in axes:
        handles.update({label: h for h, label in zip(*ax.get_legend_handles_labels()) if label not in handles})
    axes[-1].legend(list(handles.values()), list(handles), fontsize=6, loc="lower left")
    fig.suptitle("Judged against the references of 4 Dec: kept against speed-up, labels k; the rule keeps >= 0.90 "
                 "(grey); two draws pooled; every setting of 2-5 Dec")
    fig.tight_layout()
    fig.savefig(HERE / "front.png", dpi=72)


if __name__ == "__main__":
    main()
