"""Memory of one server serving several corpora against one server per corpus (resident set size).

    python scripts/corpora_memory.py CORPUS_A CORPUS_B [--question "..."]

Starts `serve --corpus A --corpus B` and then `serve --corpus A` and `serve --corpus B` side by side, asks
each corpus one question (so models, embedders and schemas are loaded and a batch has run), and reads
each server's VmRSS and VmHWM (peak) from /proc. Prints one JSON object. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(corpora: list[Path]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [a for c in corpora for a in ("--corpus", str(c))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "rag_promptcache.cli", "serve", *args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve {args} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"serve {args} did not come up in 600 s")
        time.sleep(0.5)


def ask(url: str, model: str, question: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpora", nargs="+", type=Path)
    parser.add_argument("--question", default="What does this document describe?")
    a = parser.parse_args()
    names = [c.resolve().name for c in a.corpora]
    out: dict[str, object] = {"corpora": names}
    proc, url = start(a.corpora)
    try:
        for name in names:
            ask(url, name, a.question)
        out["one_process_mib"] = memory(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    procs = []
    try:
        for c in a.corpora:
            procs.append(start([c]))
        for (p, url), name in zip(procs, names):
            ask(url, name, a.question)
        each = [memory(p.pid) for p, _ in procs]
        out["one_process_each_mib"] = each
        out["processes_total_mib"] = {k: sum(m[k] for m in each) for k in ("VmRSS", "VmHWM")}
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(60)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
