"""The front of the 2026-12-03 pick runs: kept (paired, against the base model's full prefill) against the
speed-up over the engine's own full prefill, per split, for every setting the probe and the product path
measured (pooled.json, product/pooled.json; two draws each, the speed-up their mean). The rule's kept
line is 0.90. Run from the repository root: .venv/bin/python docs/bench/pick-2026-12-03/front.py"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

HERE = Path(__file__).parent
SPLITS = ("bench", "heldout", "manuals")


def rows(path: Path, prefix: str = "") -> dict[str, dict[str, list[tuple[int, float, float]]]]:
    """setting -> split -> [(k, mean speed-up, kept)]"""
    out: dict[str, dict[str, list[tuple[int, float, float]]]] = {}
    for key, cell in json.loads(path.read_text()).items():
        setting, split, k = key.rsplit(" ", 2)
        speed = sum(cell["speedups"]) / len(cell["speedups"])
        out.setdefault(prefix + setting, {}).setdefault(split, []).append((int(k), speed, cell["kept"]))
    return out


def main() -> None:
    fronts = rows(HERE / "pooled.json") | rows(HERE / "product" / "pooled.json", "product: ")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharey=True)
    for ax, split in zip(axes, SPLITS):
        for setting, by_split in sorted(fronts.items()):
            points = sorted(by_split.get(split, []))
            if not points:
                continue
            line, = ax.plot([p[1] for p in points], [p[2] for p in points], marker="o",
                            linestyle="--" if setting.startswith("product") else "-", label=setting)
            for k, x, y in points:
                ax.annotate(f"k={k}", (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points", color=line.get_color())
        ax.axhline(0.90, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks([2, 4, 8, 16, 32])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(split)
        ax.set_xlabel("speed-up over the engine's own full prefill (log)")
    axes[0].set_ylabel("kept (paired, of the base model's full-prefill right answers)")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle("2026-12-03: kept against speed-up, two draws pooled; the rule keeps >= 0.90 (grey)")
    fig.tight_layout()
    fig.savefig(HERE / "front.png", dpi=72)


if __name__ == "__main__":
    main()
