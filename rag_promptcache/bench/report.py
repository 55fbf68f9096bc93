"""The benchmark's outputs: the JSON report, a Markdown summary (printed and saved as bench.md), and
PNG plots (TTFT against context per system; quality against TTFT, the Pareto plot of issue 7).

Only formats what the scenarios measured; computes nothing new. A ratio whose duration measured zero
(below the clock's resolution, recorded as `clock_resolution_s`) is None in the JSON and "n/a" in a
table, and left out of the plots.
"""

from __future__ import annotations

import json
from pathlib import Path

from rag_promptcache.bench.tables import table
from rag_promptcache.rag.fidelity import RULE
from rag_promptcache.timing import describe

SYSTEMS = ("full", "full_engine", "prefix", "miss", "cached_disk", "cached_memory", "lower_bound")
LLAMACPP = ("llamacpp_bf16_full", "llamacpp_q4_1_full")  # bench/llamacpp.py's TTFT rows, where it ran


def write_json(report: dict[str, object], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def markdown(report: dict[str, object]) -> str:
    out = [f"# rag-promptcache bench ({'quick' if report.get('quick') else 'full'})", "",
           f"model `{report['model']}`, device {report['device']}, {report['threads']} threads, "
           f"{report.get('dtype', '')}, torch {report.get('torch', '')}, CPU flags "
           f"{' '.join(report.get('cpu_flags', [])) or 'n/a'}, native kernels "
           f"{'on' if report.get('native_kernels') else 'off'}, {report.get('date', '')}", ""]
    if "clock_resolution_s" in report:
        out += [f"Clock resolution {report['clock_resolution_s']:.3g} s; each timed run spans at least "
                f"{report['clock_min_span_s']:.3g} s; n/a: a ratio whose duration was below the clock's resolution.", ""]
    if report.get("ttft"):
        llama = [s for s in LLAMACPP if f"{s}_s" in report["ttft"][0]]
        ratios = [f"x_{s.removesuffix('_full')}" for s in llama]  # llama.cpp's full prefill over our cached
        out += ["## TTFT (seconds, median)", "", table(
            ["context", "modules", *SYSTEMS, *llama, "speed-up vs transformers full", "speed-up vs engine full",
             *(f"{s} / cached_memory" for s in llama), "overhead vs lower bound", "miss/full", "disk/memory"],
            [[r["context_tokens"], r["modules"], *(r[f"{s}_s"] for s in SYSTEMS), *(r[f"{s}_s"] for s in llama),
              r["speedup"], r["speedup_engine"], *(r[x] for x in ratios), r["overhead_vs_lower_bound"],
              r["miss_over_full"], r["disk_over_memory"]] for r in report["ttft"]]), ""]
        measured = [r for r in report["ttft"] if r["speedup_engine"] is not None]
        worst = min(measured, key=lambda r: r["speedup_engine"]) if measured else report["ttft"][0]
        out += [f"Worst cached/full ratio over these {len(report['ttft'])} prompts (the engine's own full prefill "
                f"over the default's cached TTFT; never slower than not caching means at least 0.95x): "
                f"**{describe(worst['speedup_engine'], '.2f', 'x')}** at {worst['context_tokens']} context tokens, "
                f"{worst.get('cached_path', 'cached')} path.", ""]
    if isinstance(report.get("chat"), dict):
        out += _chat_markdown(report["chat"])
    if report.get("decode"):
        out += [f"## Decode ({report['decode'][0]['new_tokens']} new tokens, greedy, EOS ignored, "
                f"{report['decode'][0]['context_tokens']}-token context)", "",
                table(["system", "dtype", "prompt lookup", "tokens/s", "tokens per forward", "x transformers fp32",
                        "x transformers same dtype", "end to end s", "default"],
                       [[r["system"], r["dtype"], r["prompt_lookup"], r["tokens_per_s"], r["tokens_per_forward"],
                         r["x_transformers_fp32"], r["x_transformers_same_dtype"], r["end_to_end_s"],
                         "yes" if r["default"] else ""] for r in report["decode"]]), ""]
    if report.get("decode_answers"):
        a = report["decode_answers"]
        out += [f"## Decode on answers ({a['questions']} questions, ended by EOS; {a['answers_identical']} of them "
                f"answered the same with and without prompt lookup)", "",
                table(["system", "dtype", "prompt lookup", "tokens/s", "tokens per forward", "x transformers fp32",
                        "answer tokens", "default"],
                       [[r["system"], r["dtype"], r["prompt_lookup"], r["tokens_per_s"], r["tokens_per_forward"],
                         r["x_transformers_fp32"], " ".join(map(str, r["answer_tokens"])), "yes" if r["default"] else ""]
                        for r in a["rows"]]), ""]
    if report.get("quality"):
        out += ["## Quality against full prefill", "", table(
            ["k", "mode", "recovery", "codec", "questions", "top-1", "mean KL", "greedy exact", "NLL full",
             "NLL cached", "NLL change", "TTFT s", "speed-up", "default"],
            [[r["k"], r["mode"], r["recovery"], r["codec"], r["questions"], r["top1_agreement"], r["mean_kl"],
              r["greedy_exact_match"], r["nll_full"], r["nll_cached"], f"{100 * r['nll_rel_change']:+.1f}%",
              r["ttft_s"], r["speedup"], "yes" if r["default"] else ""] for r in report["quality"]]), ""]
    if report.get("memory"):
        out += ["## Memory per cached token", "", table(
            ["codec", "bytes/token", "formula", "disk bytes/token", "encode s", "decode s"],
            [[r["codec"], r["bytes_per_token"], r["formula_bytes_per_token"] or "", r.get("disk_bytes_per_token", ""),
              r.get("encode_s", ""), r.get("decode_s", "")] for r in report["memory"]]), ""]
    tiers = report.get("store_tiers")
    if isinstance(tiers, dict) and tiers:
        names = [k.removesuffix("_s") for k in tiers if k.endswith("_s") and k != "recompute_s"]
        out += [f"## One {tiers['module_tokens']}-token module: load vs recompute ({tiers['recompute_s']:.4g} s)", "",
                table(["tier", "seconds", "x faster than recompute"],
                       [[n, tiers[f"{n}_s"], tiers[f"{n}_vs_recompute"]] for n in names]), ""]
    thr = report.get("throughput")
    if isinstance(thr, dict):
        rows = [[f"encode ({r.get('what', '')}, {r['mode']})", describe(r["modules_per_s"], ".2f", " modules/s"),
                 describe(r["tokens_per_s"], ".0f", " tokens/s")]
                for r in thr.get("encode", [])]
        emb = thr.get("embed", {})
        rows.append(["embed", emb.get("skipped") or describe(emb["chunks_per_s"], ".1f", " chunks/s"), "" if "skipped" in emb
                     else f"{emb['tokens_per_s']:.0f} tokens/s"])
        rows += [[f"FAISS flat, {f['vectors']} vectors", f"{describe(f['search_ms_median'], '.3f', ' ms')} median",
                  f"{describe(f['search_ms_p95'], '.3f', ' ms')} p95"] for f in thr.get("faiss", [])]
        out += ["## Throughput", "", table(["what", "rate", ""], rows), ""]
    ing = report.get("ingest")
    if isinstance(ing, dict) and ing.get("runs"):
        from rag_promptcache.bench import ingest

        out += ingest.markdown(ing)
    fid = report.get("fidelity")
    if isinstance(fid, dict):
        out += _fidelity_markdown(fid)
    lc = report.get("langchain")
    if isinstance(lc, dict):
        out += ["## LangChain end to end", ""]
        if "skipped" in lc:
            out += [f"skipped: {lc['skipped']}", ""]
        else:
            out += [table(["chain LLM", "first streamed token s"],
                           [["HuggingFacePipeline", lc["huggingface_pipeline_first_token_s"]],
                            ["PromptCacheLLM", lc["promptcache_first_token_s"]]]),
                    "", f"speed-up {describe(lc['speedup'], '.1f', 'x')} over {lc['questions']} questions, k={lc['k']}", ""]
    if isinstance(report.get("serve"), dict):
        from rag_promptcache.bench import serve

        out += serve.markdown(report["serve"])
    if isinstance(report.get("sustained"), dict):
        from rag_promptcache.bench import sustained

        out += sustained.markdown(report["sustained"])
    return "\n".join(out)


def _chat_markdown(chat: dict[str, object]) -> list[str]:
    """Per turn TTFT per system (engine, llama.cpp with prefix reuse), then the medians of turns 2..n."""
    weights = [w for w in ("bf16", "q4_1") if f"x_llamacpp_{w}" in chat]
    header = ["repeat", "turn", "prompt tokens", "engine s", "engine computed tokens",
              *(f"llama.cpp {w} s" for w in weights), *(f"llama.cpp {w} reused tokens" for w in weights)]
    rows = [[t["repeat"], t["turn"], t["prompt_tokens"], t["engine_s"], t["engine_computed_tokens"],
             *(t[f"llamacpp_{w}_s"] for w in weights), *(t[f"llamacpp_{w}_reused_tokens"] for w in weights)]
            for t in chat["rows"]]
    summary = f"turns 2-{chat['turns']} median TTFT: engine {chat['engine_median_s']:.3f} s" + "".join(
        f"; llama.cpp {w} {chat[f'llamacpp_{w}_median_s']:.3f} s ({describe(chat[f'x_llamacpp_{w}'], '.2f', 'x')} ours)"
        for w in weights)
    return [f"## Chat turns ({chat['turns']} turns over the same {chat['context_tokens']}-token documents, "
            f"{chat['repeats']} conversation(s))", "", table(header, rows), "", summary, ""]


def _fidelity_markdown(fid: dict[str, object]) -> list[str]:
    pct = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    at = {(t["mode"], t["recovery"]): t for t in fid["ttft_at_context"]}
    ctx = next(iter(at.values()))["context_tokens"] if at else 0
    rows = [[r["k"], r["mode"], r["recovery"], f"{r['full_correct']}/{r['with_answer']}",
             f"{r['cached_correct']}/{r['with_answer']}", pct(r.get("kept")), pct(r["retained"]), pct(r["agreement"]),
             speed(r["speedup"]),
             speed(at[(r["mode"], r["recovery"])]["speedup"]) if (r["mode"], r["recovery"]) in at else ""]
            for r in fid["rows"]]
    chosen = fid.get("chosen")
    head = ["## Answer fidelity against full prefill", "",
            f"{fid['questions']} questions per split over confusable documents, greedy, {fid['new_tokens']} new tokens; "
            f"an answer is right when it contains the fact. Speed-ups divide the engine's own full prefill.", ""]
    rule = (f"engine default: {fid['engine_default']}; the rule at ~{ctx:.0f} tokens picks: "
            + (f"{chosen['mode']}/{chosen['recovery']} ({chosen['rule']})" if chosen else "nothing (no setting keeps 3x)"))
    if len(fid.get("splits", ())) > 1:  # per split, with the rule across splits and the choose-then-confirm line
        return [*head, fidelity_splits_markdown(fid), "", rule, ""]
    return [*head, table(["k", "mode", "recovery", "full right", "cached right", "kept (paired)", "retained", "agreement",
                          "speed-up",
                          f"speed-up at ~{ctx:.0f} tok"], rows), "", rule, ""]


def speed(value: float | None) -> str:
    """A speed-up as a table writes it: "2.5x", or "n/a" below the clock's resolution."""
    return "n/a" if value is None else f"{value:.1f}x"


def _setting_name(r: dict[str, object]) -> str:
    """mode/recovery, after the adapter where the model carried one."""
    adapter = r.get("adapter", "none")
    return f"{r['mode']}/{r['recovery']}" if adapter == "none" else f"{adapter}: {r['mode']}/{r['recovery']}"


def fidelity_splits_markdown(fid: dict[str, object]) -> str:
    """The fidelity rows per split: retained, share recomputed, speed-up over the engine's full prefill.
    Rows judged against a reference run (`--reference`) show its full-prefill right answers beside this
    model's own; retained and kept are then against the reference's."""
    pct = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    judged = any("reference_full_correct" in r for r in fid["rows"])
    rows = [[r.get("split", "bench"), r["k"], f"{r['context_tokens']:.0f}", _setting_name(r),
             f"{r['full_correct']}/{r['with_answer']}",
             *([f"{r['reference_full_correct']}/{r['with_answer']}" if "reference_full_correct" in r else ""] if judged else []),
             f"{r['cached_correct']}/{r['with_answer']}", pct(r["retained"]),
             pct(r.get("kept")), f"{r.get('recomputed_share', 0.0):.3f}", f"{r['full_ttft_s']:.3f}", f"{r['cached_ttft_s']:.3f}",
             speed(r["speedup"])] for r in fid["rows"]]
    chosen, confirm = fid.get("across_splits"), fid.get("chosen_then_confirmed")
    lines = [
        table(["split", "k", "context tok", "setting", "full right", *(["reference full right"] if judged else []),
               "cached right", "retained", "kept (paired)", "recomputed",
                "full TTFT s (engine)", "cached TTFT s", "speed-up (engine full)"], rows), "",
        f"the rule ({RULE} on every split at every k, then the fastest) picks: "
        + (f"{_setting_name(chosen)} (worst {_worst(chosen)}, {speed(chosen['speedup_at_largest_k'])})" if chosen else "nothing"),
    ]
    if against := fid.get("full_prefill_against_reference"):
        fewer = [f"{a['split']} k={a['k']}" for a in against if not a["at_least_as_many"]]
        lines.append("full prefill right, this model against the reference: "
                     + ", ".join(f"{a['split']} k={a['k']} {a['full_correct']} vs {a['reference_full_correct']}" for a in against)
                     + (f"; fewer at {', '.join(fewer)}" if fewer else "; at least as many everywhere"))
    if fid.get("codec_rows"):
        lines += ["", codec_markdown(fid["codec_rows"])]
    if confirm:
        retained = confirm.get("worst_retained_elsewhere", {})  # runs from before the rule read retained: kept alone
        others = (", ".join(f"{s} {_pair(retained.get(s), v)}" for s, v in confirm["worst_kept_elsewhere"].items())
                  or "no other split")
        lines.append(f"chosen on the {confirm['chosen_on']} split: {_setting_name(confirm)} (worst {_worst(confirm)}, "
                     f"{speed(confirm['speedup_at_largest_k'])}); worst retained / kept elsewhere: "
                     f"{others}: {'confirmed' if confirm['confirmed'] else 'not confirmed'}")
    return "\n".join(lines)


def _pair(retained: float | None, kept: float) -> str:
    return f"{'n/a' if retained is None else f'{retained:.2f}'} / {kept:.2f}"


def _worst(chosen: dict[str, object]) -> str:
    """A pick's worst retained and kept (a run from before the rule read retained has kept alone)."""
    return f"retained / kept {_pair(chosen.get('worst_retained'), chosen['worst_kept'])}"


def codec_markdown(rows: list[dict[str, object]]) -> str:
    """The codec rows: each codec's answers against fp16 modules' (rag/codec_eval.py) per split and k."""
    pct = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    return table(["split", "k", "codec", "bytes/token", "recovery", "fp16 modules right", "codec right", "retained",
                  "kept (paired)", "agreement", f"meets {RULE}"],
                 [[r["split"], r["k"], r["codec"], f"{r['bytes_per_token']:.0f}", r["recovery"],
                   f"{r['fp16_correct']}/{r['with_answer']}", f"{r['cached_correct']}/{r['with_answer']}",
                   pct(r["retained"]), pct(r["kept"]), f"{r['agreement']:.2f}", "yes" if r["meets"] else "no"]
                  for r in rows])


def _point_name(r: dict[str, object]) -> str:
    """A point's label on the front: the recovery, after the adapter's name where the model carried one."""
    adapter = r.get("adapter", "none")
    return r["recovery"] if adapter == "none" else f"{adapter.split('@')[0]}: {r['recovery']}"


def fidelity_front(fid: dict[str, object], path: str | Path) -> Path:
    """Retained against TTFT speed-up over the engine's full prefill, one panel per k, one colour per
    split, each split's Pareto front drawn as a step line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    rows = [r for r in fid["rows"] if r["retained"] is not None and r["speedup"] is not None]
    ks = sorted({r["k"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(ks)), figsize=(5.5 * max(1, len(ks)), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for split, colour in (("bench", "tab:blue"), ("heldout", "tab:orange"), ("manuals", "tab:green")):
            pts = sorted(((r["speedup"], r["retained"], _point_name(r)) for r in rows
                          if r["k"] == k and r.get("split", "bench") == split), reverse=True)
            if not pts:
                continue
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=colour, label=split)
            for x, y, name in pts:
                ax.annotate(name, (x, y), fontsize=7)
            front, best = [], -1.0
            for x, y, _ in pts:  # fastest first: a point is on the front when it retains more than every faster one
                if y > best:
                    front.append((x, y))
                    best = y
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", color=colour, alpha=0.5)
        ax.axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if f"{v:g}"[0] in "235" else ""))
        ax.set(xlabel="TTFT speed-up over the engine's own full prefill", ylabel="retained (cached right / full right)",
               title=f"k = {k}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Answer fidelity against speed, per k and split")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(report: dict[str, object], folder: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    ttft = report.get("ttft") or []
    if ttft:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["context_tokens"] for r in ttft]
        for s in (*SYSTEMS, *(s for s in LLAMACPP if f"{s}_s" in ttft[0])):
            ax.plot(xs, [r[f"{s}_s"] for r in ttft], marker="o", label=s, linestyle="--" if s in LLAMACPP else "-")
        ax.set(xscale="log", yscale="log", xlabel="retrieved context (tokens)", ylabel="time to first token (s)",
               title=f"TTFT vs context — {report['model']} on {report['device']}")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(folder / "ttft.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    quality = report.get("quality") or []
    if quality:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, metric, label in ((axes[0], "mean_kl", "mean first-token KL (lower is better)"),
                                  (axes[1], "greedy_exact_match", "greedy exact match (higher is better)")):
            for k in sorted({r["k"] for r in quality}):
                rows = [r for r in quality if r["k"] == k and r["speedup"] is not None]
                ax.scatter([r["speedup"] for r in rows], [r[metric] for r in rows], label=f"k={k}")
                for r in rows:
                    tag = f"{r['mode']}/{r['recovery']}" + ("" if r["codec"] == "native" else f"/{r['codec']}")
                    ax.annotate(tag + (" *" if r["default"] else ""), (r["speedup"], r[metric]), fontsize=7)
            ax.set(xlabel="TTFT speed-up over full prefill", ylabel=label)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle("Quality vs speed per mode / recovery / codec (* = default)")
        fig.tight_layout()
        written.append(folder / "quality_pareto.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    if isinstance(report.get("serve"), dict):
        from rag_promptcache.bench import serve

        written += serve.plots(report["serve"], folder)
    if isinstance(report.get("sustained"), dict):
        from rag_promptcache.bench import sustained

        written += sustained.plots(report["sustained"], folder)
    fid = report.get("fidelity")
    if isinstance(fid, dict) and fid.get("rows") and len(fid.get("splits", ())) > 1:
        written.append(fidelity_front(fid, folder / "fidelity_front.png"))
    if isinstance(fid, dict) and fid.get("rows"):
        at = {(t["mode"], t["recovery"]): t["speedup"] for t in fid["ttft_at_context"]}
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k in sorted({r["k"] for r in fid["rows"]}):
            rows = [r for r in fid["rows"] if r["k"] == k and r["retained"] is not None
                    and at.get((r["mode"], r["recovery"]), r["speedup"]) is not None]
            xs = [at.get((r["mode"], r["recovery"]), r["speedup"]) for r in rows]
            ax.scatter(xs, [r["retained"] for r in rows], label=f"k={k}")
            for x, r in zip(xs, rows):
                ax.annotate(f"{r['mode'][:3]}/{r['recovery']}", (x, r["retained"]), fontsize=7)
        ax.axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
        if any(r["retained"] is not None for r in fid["rows"]):  # none when full prefill got nothing right
            ax.set_xscale("log")
        ax.set(xlabel="TTFT speed-up over full prefill at ~2k context",
               ylabel="retained answer accuracy (cached / full)", title="Answer fidelity vs speed")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(folder / "fidelity.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written

