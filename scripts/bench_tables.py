"""Markdown tables from the bench's JSON (`rag-promptcache bench --json`), so that no measured number
is typed by hand. `python scripts/bench_tables.py RUN.json` prints the TTFT and decode tables of one
run, headed by its date, machine and command."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _num(x: object, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def header(run: dict) -> str:
    return (f"{run.get('date', '?')}, {run.get('machine', '?')}, device {run.get('device', '?')}, "
            f"model {run.get('model', '?')}, dtype {run.get('dtype', '?')}, torch {run.get('torch', '?')}")


def ttft_table(run: dict) -> str:
    rows = ["| context tokens | full prefill (s) | cached (s) | speed-up | engine's full prefill (s) |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    for r in run.get("ttft", []):
        rows.append(f"| {r['context_tokens']} | {_num(r.get('full_s'), '.4f')} | {_num(r.get('cached_memory_s'), '.4f')} "
                    f"| {_num(r.get('speedup'), '.1f')}x | {_num(r.get('full_engine_s'), '.4f')} |")
    return "\n".join(rows)


def decode_table(run: dict) -> str:
    rows = ["| system | dtype | prompt lookup | context tokens | tokens/s | default |",
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in run.get("decode", []):
        rows.append(f"| {r['system']} | {r['dtype']} | {r.get('prompt_lookup', 0)} | {r.get('context_tokens', '-')} "
                    f"| {_num(r.get('tokens_per_s'), '.1f')} | {'yes' if r.get('default') else ''} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/bench_tables.py RUN.json", file=sys.stderr)
        return 2
    run = json.loads(Path(argv[0]).read_text())
    print(f"Run: {header(run)}.\n")
    if run.get("ttft"):
        print("TTFT (time to the first token):\n\n" + ttft_table(run) + "\n")
    if run.get("decode"):
        print("Decode:\n\n" + decode_table(run) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
