"""The large sustained scenario's numbers, checks, table and plot, from the rows its run recorded
(benchmarks/sustained_large.py): per window of questions, the share of module tokens served from the store,
TTFT p50/p95 of the corpus's questions, of full prefill and of a fully eager fp16 unlimited store, the
speed-ups, bytes per tier against the budget. Formatting and arithmetic only.
"""

from __future__ import annotations

from pathlib import Path

STEADY = 0.9


def _quantile(xs: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least a share `q` of the values at or below it."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, -(-int(q * 1000) * len(xs) // 1000) - 1))]


def _p50(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def window(rows: list[dict[str, object]], limits: dict[str, int]) -> dict[str, object]:
    timed = [r for r in rows if r["full_s"] is not None]
    cached = [r["cached_s"] for r in rows]
    full, eager = [r["full_s"] for r in timed], [r["eager_s"] for r in timed]
    same = [r["cached_s"] for r in timed]  # the corpus's TTFT of the questions also timed the other ways

    def speedup(base: list[float], over: list[float]) -> float | None:
        b, o = _p50(base), _p50(over)
        return b / o if b and o else None

    out = {
        "questions": [rows[0]["question"], rows[-1]["question"]],
        "served_share": sum(r["served_tokens"] for r in rows) / max(1, sum(r["module_tokens"] for r in rows)),
        "ttft_p50": _p50(cached), "ttft_p95": _quantile(cached, 0.95),
        "full_p50": _p50(full), "full_p95": _quantile(full, 0.95), "eager_p50": _p50(eager),
        "speedup": speedup(full, same), "eager_speedup": speedup(full, eager),
        "full_path": sum(r["path"] == "full" for r in rows), "misses": sum(r["misses"] for r in rows),
        "peak": {n: max(r["tiers"].get(n, {}).get("bytes", 0) for r in rows) for n in limits},
    }
    s, e = out["speedup"], out["eager_speedup"]
    out["vs_eager"] = s / e if s and e else None
    return out


def summarize(tiers: str, rows: list[dict[str, object]], limits: dict[str, int], warmup: int, every: int,
              replayed: dict[str, dict[str, object]], coverage: object) -> dict[str, object]:
    measured = rows[warmup:]
    windows = [window(measured[b:b + every], limits) for b in range(0, len(measured) - every + 1, every)]
    first, last = windows[0], windows[-1]
    over = [f"{n} {r['tiers'][n]['bytes']} > {limit} after question {r['question']}"
            for r in rows for n, limit in limits.items() if r["tiers"].get(n, {}).get("bytes", 0) > limit]
    served = last["served_share"] / first["served_share"] if first["served_share"] else 0.0
    peaks = ", ".join(f"{n} {max(r['tiers'][n]['bytes'] for r in rows)}/{b}" for n, b in limits.items())
    checks = {
        "served_steady": {"passed": served >= STEADY,
                          "detail": f"last {last['served_share']:.3f} / first {first['served_share']:.3f} = {served:.3f} "
                                    f"(>= {STEADY})"},
        "speedup_vs_eager": {"passed": last["vs_eager"] is not None and last["vs_eager"] >= STEADY,
                             "detail": f"last window's p50 speed-up {_x(last['speedup'])} over an eager unlimited fp16 "
                                       f"store's {_x(last['eager_speedup'])}: {_num(last['vs_eager'])} (>= {STEADY})"},
        "budgets": {"passed": not over, "detail": "; ".join(over[:3]) or f"every tier within budget after every "
                    f"question (peaks {peaks})"},
    }
    return {"tiers": tiers, "budgets": limits, "windows": windows, "checks": checks, "rows": rows,
            "replay": replayed, "encoded_at_end": {"modules": coverage.num_encoded, "tokens": coverage.num_encoded_tokens,
                                                   "share": coverage.share}}


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def markdown(report: dict[str, object]) -> list[str]:
    from rag_promptcache.bench.tables import table

    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    ing = report["ingest"]
    out = [f"## Sustained, large: {report['corpus_tokens']:,} tokens of real text ({report['modules']:,} modules, "
           f"fp16 KV {report['fp16_bytes'] / 2**30:.1f} GiB), lazy, codec {report['codec']}, k={report['k']}, "
           f"{report['questions']} questions after {report['warmup']}, Zipf {report['zipf']} over documents", "",
           f"Lazy ingest {ing['lazy_seconds']:.0f} s ({ing['lazy_tokens_per_s']:.0f} tokens/s), store "
           f"{ing['store_bytes_after']} bytes after it; eager {ing['eager_tokens_per_s']:.0f} tokens/s on a "
           f"{ing['eager_slice_tokens']:,}-token slice, {ing['eager_seconds_estimate']:.0f} s for the whole: lazy "
           f"{ing['lazy_speedup']:.1f}x faster.", ""]
    for r in report["runs"]:
        if "skipped" in r:
            out += [f"### {r['tiers']}: skipped ({r['skipped']})", ""]
            continue
        rows = []
        for w in r["windows"]:
            rows.append([f"{w['questions'][0] + 1}-{w['questions'][1] + 1}", f"{w['served_share']:.3f}",
                         _s(w["ttft_p50"]), _s(w["ttft_p95"]), _s(w["full_p50"]), _s(w["full_p95"]),
                         _x(w["speedup"]), _x(w["eager_speedup"]), _num(w["vs_eager"]),
                         ", ".join(f"{n} {mib(w['peak'][n])}/{mib(b)}" for n, b in r["budgets"].items())])
        out += [f"### {r['tiers']}", "", table(
            ["questions", "served share", "TTFT p50 s", "p95 s", "full prefill p50 s", "p95 s", "speed-up p50",
             "eager unlimited fp16", "vs eager", "peak / budget MiB"], rows), ""]
        out.append("checks: " + "; ".join(f"{n} {'pass' if c['passed'] else 'FAIL'} ({c['detail']})"
                                          for n, c in r["checks"].items()))
        out += ["", "eviction replayed on this run's accesses (served share after the warm-up): " + "; ".join(
            f"budget x{scale:g}: " + ", ".join(f"{p} {v['served_share']:.3f}" for p, v in policies.items())
            for scale, policies in r["replay"].items()), ""]
    out.append("checks: " + "; ".join(f"{n} {'pass' if c['passed'] else 'FAIL'} ({c['detail']})"
                                      for n, c in report["checks"].items()))
    return out + ["", f"all checks passed: {'yes' if report['passed'] else 'NO'}", ""]


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def plots(report: dict[str, object], folder: Path) -> list[Path]:
    from rag_promptcache.bench.tables import grid, save

    runs = [r for r in report["runs"] if "windows" in r]
    if not runs:
        return []
    fig, axes = grid(len(runs), 3, 16, 3.8)
    for (share, ttft, held), r in zip(axes, runs):
        xs = [w["questions"][1] + 1 for w in r["windows"]]
        share.plot(xs, [w["served_share"] for w in r["windows"]], marker="o", label="this run")
        for policy, rep in r["replay"][1.0].items():
            share.plot(xs[:len(rep["windows"])], rep["windows"], linestyle="--", label=f"replayed: {policy}")
        share.set(ylim=(0, 1.02), xlabel="question", ylabel="module tokens served from the store",
                  title=f"{r['tiers']}: served share per {report['every']}")
        for key, label in (("ttft_p50", "TTFT p50"), ("full_p50", "full prefill p50"), ("eager_p50", "eager fp16 p50")):
            ttft.plot(xs, [w[key] or float("nan") for w in r["windows"]], marker="o", label=label)
        ttft.set(xlabel="question", ylabel="seconds", title=f"{r['tiers']}: time to first token")
        qs = [row["question"] + 1 for row in r["rows"]]
        for name, limit in r["budgets"].items():
            line = held.plot(qs, [row["tiers"].get(name, {}).get("bytes", 0) / 2**20 for row in r["rows"]], label=name)
            held.axhline(limit / 2**20, color=line[0].get_color(), linestyle=":", linewidth=1)
        held.set(xlabel="question", ylabel="MiB", title=f"{r['tiers']}: bytes per tier (dotted: budget)")
        for ax in (share, ttft, held):
            ax.axvline(report["warmup"] + 0.5, color="grey", linestyle="--", linewidth=0.8)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    return [save(fig, Path(folder) / "sustained_large.png")]
