"""Every measured table in the README and the docs, written from the bench's JSON in docs/bench/, so
that no number is typed by hand.

A table is a marker pair in a Markdown file:

    <!-- bench-table kind=ttft json=docs/bench/RUN/ttft.json cmd="rag-promptcache bench ..." -->
    (generated: a caption naming the run's date, machine, command and recovery, then the table)
    <!-- /bench-table -->

`python scripts/bench_tables.py` rewrites what lies between the markers in README.md and docs/*.md;
`--check` exits 1 if any of it differs from what the JSON gives (tests/test_docs.py runs it);
`python scripts/bench_tables.py RUN.json` prints one run's TTFT and decode tables (make gpu-check).
Kinds: ttft, ttft-systems, decode, decode-answers, chat, serve, fidelity, quality, memory, sustained,
sustained-large, sustained-large-checks, ingest, headline,
and shape-ttft, shape-decode (the JSON of benchmarks/shape.py, which the one-run form prints too).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"(<!-- bench-table (?P<args>.*?) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)


def _num(x: object, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _x(x: object) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}x"


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _machine(run: dict) -> str:
    flags = " ".join(f for f in run.get("cpu_flags", []) if "bf16" in f) if isinstance(run.get("cpu_flags"), list) else ""
    parts = [str(run.get("machine", "?")), str(run.get("device", "?")) + (f" ({flags})" if flags else "")]
    if run.get("threads"):
        parts.append(f"{run['threads']} threads")
    return ", ".join(parts)


def caption(run: dict, cmd: str, recovery: str | None, link: str) -> str:
    date = str(run.get("date", "?")).replace("T", " ")[:16]
    bits = [f"{date} UTC", _machine(run), f"{run.get('dtype', '?')}, torch {run.get('torch', '?')}"]
    if recovery:
        bits.append(f"recovery `{recovery}`")
    return f"*{'; '.join(bits)}. Command: `{cmd}`. Data: [{Path(link).name}]({link}).*"


def _recovery(rows: list[dict]) -> str | None:
    found = sorted({str(r["recovery"]) for r in rows if r.get("recovery")})
    return ", ".join(found) or None


# -- the kinds: (run JSON) -> (table, the recovery it ran with, if the JSON says) -------------------

def ttft(run: dict) -> tuple[str, str | None]:
    """Cached TTFT against the full prefills it divides, one row per context size."""
    rows = run["ttft"]
    has_engine = any("full_engine_s" in r for r in rows)
    has_llama = any("llamacpp_bf16_full_s" in r for r in rows)
    header = ["context tokens", "modules", "cached (s)", "transformers full (s)", "speed-up"]
    if has_engine:
        header += ["engine's full (s)", "speed-up vs engine"]
    if has_llama:
        header += ["llama.cpp bf16 full (s)", "vs llama.cpp bf16", "llama.cpp Q4_1 full (s)", "vs Q4_1"]
    out = []
    for r in rows:
        row = [r["context_tokens"], r["modules"], _num(r["cached_memory_s"]), _num(r["full_s"]), _x(r.get("speedup"))]
        if has_engine:
            row += [_num(r.get("full_engine_s")), _x(r.get("speedup_engine"))]
        if has_llama:
            row += [_num(r.get("llamacpp_bf16_full_s")), _x(r.get("x_llamacpp_bf16")),
                    _num(r.get("llamacpp_q4_1_full_s")), _x(r.get("x_llamacpp_q4_1"))]
        out.append(row)
    return _table(header, out), _recovery(rows)


def ttft_systems(run: dict) -> tuple[str, str | None]:
    """Every system of the TTFT scenario (seconds), and the ratios the targets were set on."""
    rows = run["ttft"]
    header = ["context", "modules", "full", "prefix", "miss", "cached disk", "cached memory", "lower bound",
              "speed-up", "vs lower bound", "miss/full", "disk/memory"]
    out = [[r["context_tokens"], r["modules"], _num(r["full_s"]), _num(r["prefix_s"]), _num(r["miss_s"]),
            _num(r["cached_disk_s"]), _num(r["cached_memory_s"]), _num(r["lower_bound_s"]), f"**{_x(r['speedup'])}**",
            _num(r["overhead_vs_lower_bound"], ".2f"), _num(r["miss_over_full"], ".2f"), _num(r["disk_over_memory"], ".2f")]
           for r in rows]
    return _table(header, out), _recovery(rows)


def _decode_rows(rows: list[dict]) -> str:
    header = ["system", "dtype", "prompt lookup", "tokens/s", "tokens per forward", "x transformers fp32"]
    out = []
    for r in rows:
        name = f"**{r['system']} (default)**" if r.get("default") else r["system"]
        weights = f" ({r['weights']})" if r.get("weights") else ""
        out.append([name + weights, r["dtype"], r.get("prompt_lookup", 0) or "off", _num(r["tokens_per_s"], ".1f"),
                    _num(r.get("tokens_per_forward"), ".2f"), _num(r.get("x_transformers_fp32"), ".2f")])
    return _table(header, out)


def decode(run: dict) -> tuple[str, str | None]:
    """Tokens/s of 128 greedy tokens after a cached context, EOS ignored."""
    return _decode_rows(run["decode"]), None


def decode_answers(run: dict) -> tuple[str, str | None]:
    """Tokens/s on answers as a user gets them (EOS and the corpus's no-repeat rule)."""
    return _decode_rows(run["decode_answers"]["rows"]), None


def chat(run: dict) -> tuple[str, str | None]:
    c = run["chat"]
    header = ["turns 2-6, median TTFT (s)", "rag-promptcache", "rag-promptcache, prefix cache off", "llama.cpp bf16",
              "llama.cpp Q4_1"]
    rows = [["seconds", f"**{_num(c['engine_median_s'])}**", _num(c["engine_no_prefix_median_s"]),
             _num(c.get("llamacpp_bf16_median_s")), _num(c.get("llamacpp_q4_1_median_s"))],
            ["ours sooner by", "", "", _x(c.get("x_llamacpp_bf16")), _x(c.get("x_llamacpp_q4_1"))]]
    return _table(header, rows), None


def _ms(r: dict, key: str) -> str:
    return "-" if r.get(key) is None else f"{1e3 * r[key]:.0f}"


def serve(run: dict) -> tuple[str, str | None]:
    """The serve scenario's rows (bench/serve.py: the faster of a leg's runs), new questions unless the mode says repeats."""
    header = ["system", "clients", "mode", "prefill", "tokens/s", "TTFT p50 / p95 s", "inter-token p50 / p95 ms",
              "longest stall s", "latency p50 s", "prompt tokens computed"]
    out = []
    for r in run["serve"]["rows"]:
        system = r.get("system", "rag-promptcache")
        chunk = r.get("prefill_chunk")
        admitted = "" if r.get("admission") in (None, "all") else f", admission {r['admission']}"  # bench/serve.py
        prefill = "-" if r["mode"] == "8 one at a time" or system != "rag-promptcache" else str(chunk or "whole" + admitted)
        out.append([system, r["clients"], r["mode"], prefill, _num(r["tokens_per_s"], ".1f"),
                    f"{_num(r['ttft_p50_s'], '.2f')} / {_num(r['ttft_p95_s'], '.2f')}",
                    _ms(r, "itl_p50_s") + " / " + _ms(r, "itl_p95_s"), _num(r.get("itl_max_s"), ".2f"),
                    _num(r["latency_p50_s"], ".1f"),
                    "-" if "computed_tokens_per_request" not in r else  # runs before the count
                    f"{r['computed_tokens_per_request']:.0f} of {r['prompt_tokens_per_request']:.0f}"])
    return _table(header, out), None


def _fidelity_setting(r: dict) -> str:
    """A fidelity row's setting: the recovery (after its mode where not shared_prefix, after the adapter
    where the model carried one)."""
    name = r["recovery"] if r["mode"] == "shared_prefix" else f"{r['mode']}/{r['recovery']}"
    adapter = r.get("adapter", "none")
    return name if adapter == "none" else f"{adapter.split('@')[0]}: {name}"


def fidelity(run: dict) -> tuple[str, str | None]:
    """Retained share of full prefill's right answers and TTFT speed-up, per setting, split and k (split
    order: bench, heldout, manuals)."""
    rows = run["rows"]
    cols = sorted({(r["split"], r["k"]) for r in rows}, key=lambda c: (c[0] != "bench", c[0], c[1]))
    settings = list(dict.fromkeys(_fidelity_setting(r) for r in rows))
    picked = run.get("across_splits") or run.get("chosen")
    chosen = None if not picked else _fidelity_setting(picked)
    ctx = {c: round(next(r["context_tokens"] for r in rows if (r["split"], r["k"]) == c)) for c in cols}
    header = ["setting"] + [f"{s} k={k} ({ctx[(s, k)]} tok)" for s, k in cols]
    out = []
    for name in settings:
        cells = []
        for c in cols:
            r = next((r for r in rows if (r["split"], r["k"]) == c and _fidelity_setting(r) == name), None)
            cells.append("-" if r is None else f"{r['retained']:.2f} · {_x(r['speedup'])}")
        label = f"`{name}`" + (" (chosen)" if name == chosen else "")
        out.append([f"**{label}**" if name == chosen else label] + cells)
    full = ", ".join(f"{s} k={k}: {next(r['full_correct'] for r in rows if (r['split'], r['k']) == (s, k))}/"
                     f"{next(r['with_answer'] for r in rows if (r['split'], r['k']) == (s, k))}" for s, k in cols)
    note = f"\n\nEach cell: retained · speed-up. Full prefill's right answers: {full}."
    return _table(header, out) + note, chosen


def quality(run: dict) -> tuple[str, str | None]:
    """First-token and continuation metrics against full prefill (the `quality` scenario)."""
    header = ["k", "mode", "codec", "recovery", "top-1", "mean KL", "greedy exact", "NLL change", "speed-up"]
    out = [[r["k"], r["mode"], r["codec"], f"**{r['recovery']}**" if r.get("default") else r["recovery"],
            _num(r["top1_agreement"], ".2f"), _num(r["mean_kl"]), _num(r["greedy_exact_match"], ".2f"),
            f"{r['nll_rel_change']:+.1%}", _x(r.get("speedup"))] for r in run["quality"]]
    return _table(header, out), None


def memory(run: dict) -> tuple[str, str | None]:
    header = ["codec", "bytes per token (memory)", "formula", "on disk"]
    out = [[r["codec"], f"{r['bytes_per_token']:,.0f}", f"{r['formula_bytes_per_token']:,.0f}",
            f"{r['disk_bytes_per_token']:,.0f}"] for r in run["memory"]]
    return _table(header, out), None


def shape_ttft(run: dict) -> tuple[str, str | None]:
    """The shape bench (benchmarks/shape.py): TTFT per context against transformers' full prefill."""
    header = ["context tokens", "modules", "transformers full (s)", "engine full (s)", "`none`, GPU tier (s)",
              "speed-up", "`none`, host (s)", "default, GPU tier (s)", "speed-up", "default, host (s)",
              "auto (s)", "auto path", "auto speed-up"]
    out = [[r["context_tokens"], f"{r['modules']} x {r['module_tokens']}", _num(r["full_s"], ".4f"),
            _num(r["full_engine_s"], ".4f"), _num(r["none_gpu_s"], ".4f"), f"**{_x(r['speedup_none'])}**",
            _num(r["none_host_s"], ".4f"), _num(r["default_gpu_s"], ".4f"), f"**{_x(r['speedup_default'])}**",
            _num(r["default_host_s"], ".4f"), _num(r["auto_s"], ".4f"), r["auto_path"], _x(r["speedup_auto"])]
           for r in run["ttft"]]
    return _table(header, out), _recovery(run["ttft"])


def shape_decode(run: dict) -> tuple[str, str | None]:
    """The shape bench's decode: tokens/s after its first context's prompt."""
    return _decode_rows(run["decode"]), None


def sustained(run: dict) -> tuple[str, str | None]:
    """Per tier set: the first and last windows' speed-up and served share, peak bytes against budgets, checks."""
    s = run["sustained"]
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    verdict = lambda c: "pass" if c["passed"] else "not judged" if c["passed"] is None else "**FAIL**"  # noqa: E731
    header = ["tiers", f"speed-up, questions {s['warmup'] + 1}-{s['warmup'] + s['window']}",
              f"speed-up, last {s['window']}", "served from caches, first / last", "peak / budget MiB",
              "prefix cache peak / budget MiB", "checks"]
    out = []
    for r in s["runs"]:
        if "skipped" in r:
            out.append([r["tiers"], f"skipped: {r['skipped']}", "", "", "", "", ""])
            continue
        samples = [r["after_ingest"], *r["rows"]]
        peaks = ", ".join(f"{n} {mib(max(x['tiers'][n]['bytes'] for x in samples))} / {mib(b)}"
                          for n, b in r["budgets"].items())
        out.append([r["tiers"], _x(r["first"]["speedup"]), _x(r["last"]["speedup"]),
                    f"{r['first']['served_share']:.2f} / {r['last']['served_share']:.2f}", peaks,
                    f"{mib(max(x['prefix']['bytes'] for x in r['rows']))} / {mib(r['prefix_budget'])}",
                    ", ".join(f"{n} {verdict(c)}" for n, c in r["checks"].items())])
    return _table(header, out), None


def sustained_large(run: dict) -> tuple[str, str | None]:
    """The large sustained run: per tier set and window of questions, the served share, TTFT p50/p95 of the
    corpus and of full prefill, the speed-ups (and an eager unlimited fp16 store's), peak bytes per tier."""
    s = run["sustained_large"]
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    header = ["tiers", "questions", "served share", "TTFT p50 / p95 s", "full prefill p50 / p95 s", "speed-up p50",
              "eager unlimited fp16", "vs eager", "peak / budget MiB"]
    out = []
    for r in s["runs"]:
        if "skipped" in r:
            out.append([r["tiers"], f"skipped: {r['skipped']}", *[""] * 7])
            continue
        for w in r["windows"]:
            out.append([r["tiers"], f"{w['questions'][0] + 1 - s['warmup']}-{w['questions'][1] + 1 - s['warmup']}",
                        f"{w['served_share']:.2f}", f"{_num(w['ttft_p50'], '.2f')} / {_num(w['ttft_p95'], '.2f')}",
                        f"{_num(w['full_p50'], '.2f')} / {_num(w['full_p95'], '.2f')}", _x(w["speedup"]),
                        _x(w["eager_speedup"]), _num(w["vs_eager"], ".2f"),
                        ", ".join(f"{n} {mib(w['peak'][n])} / {mib(b)}" for n, b in r["budgets"].items())])
    return _table(header, out), None


def sustained_large_checks(run: dict) -> tuple[str, str | None]:
    """The large sustained run's targets, each with its measured value, and the eviction replay."""
    s = run["sustained_large"]
    verdict = lambda c: "met" if c["passed"] else "**missed**"  # noqa: E731
    rows = [["all", name, verdict(c), c["detail"]] for name, c in s["checks"].items()]
    for r in s["runs"]:
        rows += [[r["tiers"], name, verdict(c), c["detail"]] for name, c in r.get("checks", {}).items()]
        for scale, policies in r.get("replay", {}).items():
            rows.append([r["tiers"], f"eviction replayed at {float(scale):g}x the budget", "",
                         ", ".join(f"{p} {v['served_share']:.3f}" for p, v in policies.items())])
    return _table(["tiers", "check", "", "measured"], rows), None


def ingest(run: dict) -> tuple[str, str | None]:
    """Eager ingest against the engine's full prefill, lazy against eager (bench/ingest.py)."""
    i = run["ingest"]
    rows = [[r["run"], _num(r["seconds"], ".1f"), _num(r["tokens_per_s"], ".0f"),
             _num(r["tokens_per_s"] / i["full_prefill_tokens_per_s"], ".2f") if i.get("full_prefill_tokens_per_s") else "-"]
            for r in i["runs"]]
    rows.append([f"full prefill ({i['full_prefill'][0]['tokens']} tokens)", "", _num(i["full_prefill_tokens_per_s"], ".0f"),
                 "1.00"])
    return _table(["run", "seconds", "tokens/s", "of full prefill"], rows), None


KINDS: dict[str, Callable[[dict], tuple[str, str | None]]] = {
    "ttft": ttft, "ttft-systems": ttft_systems, "decode": decode, "decode-answers": decode_answers, "chat": chat,
    "serve": serve, "fidelity": fidelity, "quality": quality, "memory": memory, "shape-ttft": shape_ttft,
    "shape-decode": shape_decode, "sustained": sustained, "sustained-large": sustained_large,
    "sustained-large-checks": sustained_large_checks, "ingest": ingest,
}


# -- the README's headline table: one number per row, each from its run -----------------------------

def _load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def _ttft_at(path: str, context: int, key: str) -> float:
    return next(r[key] for r in _load(path)["ttft"] if r["context_tokens"] == context)


# the shipped adapter on today's prompts, against the base model's full prefill of the same prompts (4 Dec)
SHIPPED_POOLED = "docs/bench/reference-2026-12-04/shipped-pooled/both/fidelity.json"
SHIPPED_DRAW0 = "docs/bench/links-2026-11-27/front-draw0/fidelity.json"  # with --ttft-point
BASE_POOLED = "docs/bench/reference-2026-12-04/base-pooled/both/fidelity.json"  # the references' own `none` rows


def _ttft_point(path: str, recovery: str) -> float:
    return next(r["speedup"] for r in _load(path)["ttft_at_context"] if r["recovery"] == recovery)


def _worst_retained(path: str, recovery: str, key: str = "retained") -> float:
    return min(r[key] for r in _load(path)["rows"] if r["recovery"] == recovery)


HEADLINE = [
    # (what, the number from the JSON, the page, the data, the command)
    ("TTFT at ~2k tokens (19 short chunks), the default (tuned, `last:1`), against the engine's own full prefill",
     lambda: _x(_ttft_point(SHIPPED_DRAW0, "last:1")),
     "FIDELITY.md#the-whole-front-measured-quietly-both-draws-manuals-last1-2026-11-27-night", SHIPPED_DRAW0,
     "python -m benchmarks.fidelity --split both --k 4 8 12 --adapter DIR --reference BASE.json --ttft-point ..."),
    ("TTFT at 2k tokens, the untuned default (`last:3`), against llama.cpp bf16 (same weights)",
     lambda: _x(_ttft_at("docs/bench/ttft-last3-2026-11-25/ttft.json", 2048, "x_llamacpp_bf16")),
     "benchmarks.md#shuffled-documents", "docs/bench/ttft-last3-2026-11-25/ttft.json",
     "rag-promptcache bench --quick --threads 2 --scenarios ttft --contexts 512,2048"),
    ("TTFT at 2k tokens, `recovery=\"none\"`, against transformers' full prefill",
     lambda: _x(_ttft_at("docs/bench/native-2026-11-24/ttft-none-bfloat16.json", 2048, "speedup")),
     "benchmarks.md#time-to-first-token", "docs/bench/native-2026-11-24/ttft-none-bfloat16.json",
     "rag-promptcache bench --threads 2 --scenarios ttft --contexts 2048,4096 --recovery none"),
    ("Chat turns 2-6, median TTFT: ours / llama.cpp bf16 (s)",
     lambda: (lambda c: f"{c['engine_median_s']:.3f} / {c['llamacpp_bf16_median_s']:.3f}")(
         _load("docs/bench/chat-2026-11-25/chat.json")["chat"]),
     "benchmarks.md#chat-turns", "docs/bench/chat-2026-11-25/chat.json",
     "rag-promptcache bench --threads 2 --scenarios chat"),
    ("Decode, tokens/s: the default / llama.cpp bf16",
     lambda: (lambda rows: f"{next(r for r in rows if r.get('default'))['tokens_per_s']:.1f} / "
              f"{next(r for r in rows if r['system'] == 'llama.cpp' and r['dtype'] == 'bfloat16')['tokens_per_s']:.1f}")(
         _load("docs/bench/decode-native-2026-11-25/decode.json")["decode"]),
     "benchmarks.md#decode-against-llamacpp", "docs/bench/decode-native-2026-11-25/decode.json",
     "rag-promptcache bench --quick --threads 2 --scenarios decode --decode-dtypes bfloat16"),
    ("Right answers retained / kept on look-alike documents, the default (tuned, `last:1`), worst cell",
     lambda: f"{_worst_retained(SHIPPED_POOLED, 'last:1'):.2f} / {_worst_retained(SHIPPED_POOLED, 'last:1', 'kept'):.2f}",
     "fidelity.md", SHIPPED_POOLED,
     "python -m benchmarks.fidelity --split both --k 4 8 12 --adapter default --reference BASE.json ... --pool"),
    ("Right answers retained with `recovery=\"none\"`, worst cell: tuned / untuned",
     lambda: f"{_worst_retained(SHIPPED_POOLED, 'none'):.2f} / {_worst_retained(BASE_POOLED, 'none'):.2f}",
     "fidelity.md", SHIPPED_POOLED,
     "python -m benchmarks.fidelity --split both --k 4 8 12 --adapter default --reference BASE.json ... --pool"),
]


def headline(here: Path) -> str:
    rows = []
    for what, value, page, data, cmd in HEADLINE:
        page_link = os.path.relpath(ROOT / "docs" / page.split("#")[0], here.parent) + (
            "#" + page.split("#")[1] if "#" in page else "")
        data_link = os.path.relpath(ROOT / data, here.parent)
        rows.append([what, f"**{value()}**", f"[page]({page_link}), [data]({data_link})", f"`{cmd}`"])
    return _table(["measured (2-core CPU, SmolLM2-135M, bf16)", "", "where", "command"], rows)


# -- markers ----------------------------------------------------------------------------------------

def render(args: str, here: Path) -> str:
    opts = dict(part.split("=", 1) for part in shlex.split(args))
    kind = opts.get("kind", "")
    if kind == "headline":
        return headline(here) + "\n"
    if kind not in KINDS:
        raise ValueError(f"{here}: bench-table kind={kind!r}; valid: {', '.join([*KINDS, 'headline'])}")
    if "json" not in opts or "cmd" not in opts:
        raise ValueError(f"{here}: a bench-table needs json= and cmd= ({args})")
    run = json.loads((ROOT / opts["json"]).read_text())
    table, recovery = KINDS[kind](run)
    link = os.path.relpath(ROOT / opts["json"], here.parent)
    return caption(run, opts["cmd"], opts.get("recovery", recovery), link) + "\n\n" + table + "\n"


def rewrite(path: Path) -> str:
    text = path.read_text()
    return MARKER.sub(lambda m: m.group(1) + render(m.group("args"), path) + m.group(4), text)


def files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str]) -> int:
    if argv and argv[0].endswith(".json"):
        run = json.loads(Path(argv[0]).read_text())
        if run.get("kind") == "shape":
            print(caption(run, f"python -m benchmarks.shape --shape {run['shape']} ...",
                          _recovery(run["ttft"]), argv[0]) + "\n")
            for kind, table in (("ttft", shape_ttft), ("decode", shape_decode)):
                if run.get(kind):
                    print(table(run)[0] + "\n")
            return 0
        print(caption(run, "rag-promptcache bench ...", _recovery(run.get("ttft", [])), argv[0]) + "\n")
        if run.get("ttft"):
            print(ttft(run)[0] + "\n")
        if run.get("decode"):
            print(decode(run)[0] + "\n")
        return 0
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python scripts/bench_tables.py [--check | RUN.json]", file=sys.stderr)
        return 2
    stale = []
    for path in files():
        new = rewrite(path)
        if new != path.read_text():
            stale.append(path.relative_to(ROOT))
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"stale measured tables in {', '.join(map(str, stale))}: run python scripts/bench_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
