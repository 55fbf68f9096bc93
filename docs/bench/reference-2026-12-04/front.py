"""The front judged against today's references (docs/FIDELITY.md, "2026-12-04 (night)"): kept (paired, of the
base model's full-prefill right answers) against the speed-up over each setting's own full prefill, per split
and k, for every setting of 2-4 Dec rejudged by rejudge.sh (two draws pooled unless a label says otherwise),
the untuned model's `none` (base-pooled/, the references' own rows) and the default drawn bold. The rule's
kept line is 0.90. No model runs; from the repository root:
    .venv/bin/python docs/bench/reference-2026-12-04/front.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

HERE = Path(__file__).parent
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


def family(name: str, setting: str) -> dict[str, list[tuple[int, float, float]]]:
    """split -> [(k, mean speed-up over the draws, kept)] from a rejudged family's pooled.json"""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for key, cell in json.loads((HERE / "rejudged" / name / "pooled.json").read_text()).items():
        s, split, k = key.rsplit(" ", 2)
        if s == setting:
            out.setdefault(split, []).append((int(k), sum(cell["speedups"]) / len(cell["speedups"]), cell["kept"]))
    return out


def untuned() -> dict[str, list[tuple[int, float, float]]]:
    """The base model's `none` against its own full prefill (benchmarks.fidelity --pool's rows)"""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for r in json.loads((HERE / "base-pooled" / "both" / "fidelity.json").read_text())["rows"]:
        out.setdefault(r["split"], []).append((r["k"], r["speedup"], r["kept"]))
    return out


def main() -> None:
    fronts = [(label, family(name, setting)) for name, setting, label in LINES]
    fronts.append(("untuned `none` (bench, held-out)", untuned()))
    colours = dict(zip([label for label, _ in fronts[1:]], plt.get_cmap("tab20").colors))
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
    axes[-1].legend(*axes[0].get_legend_handles_labels(), fontsize=6.5, loc="lower left")  # bench has every line
    fig.suptitle("Judged against the references of 4 Dec: kept against speed-up, labels k; the rule keeps >= 0.90 "
                 "(grey); two draws pooled")
    fig.tight_layout()
    fig.savefig(HERE / "front.png", dpi=72)


if __name__ == "__main__":
    main()
