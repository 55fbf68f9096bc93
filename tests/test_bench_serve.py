"""The serve scenario (bench/serve.py): new questions in every leg, exact repeats apart, and the llama-server
row, driven against a stand-in `llama-server` (a Python script that speaks its /health and streaming
/completion routes), since the real binary is not built here."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from rag_promptcache.bench import llama_server, serve
from rag_promptcache.bench.serve_questions import TIMED, WARM, legs
from tests.store_helpers import free_port

FAKE = '''
import argparse, json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("-m"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("-t"); p.add_argument("-tb"); p.add_argument("--parallel"); p.add_argument("-c")
p.add_argument("--cont-batching", action="store_true")
args = p.parse_args()
record = {record!r}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(record, "a") as f:
            f.write(json.dumps({{**body, "port": args.port}}) + "\\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["n_predict"]):
            self.wfile.write(("data: " + json.dumps({{"content": "" if i == 1 else "x", "stop": False}}) + "\\n\\n").encode())
            self.wfile.flush()
            time.sleep(0.001)
        done = {{"content": "", "stop": True, "tokens_predicted": body["n_predict"],
                "timings": {{"prompt_n": len(body["prompt"]) - 2}}}}
        self.wfile.write(("data: " + json.dumps(done) + "\\n\\n").encode())


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
'''


def fake_server(tmp_path: Path) -> tuple[Path, Path]:
    """An executable stand-in for llama-server → (its path, the file it appends each request body to)."""
    record = tmp_path / "requests.jsonl"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + FAKE.format(record=str(record)))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary, record


def test_warm_up_and_timed_questions_never_meet_and_legs_take_new_ones():
    assert not set(WARM) & set(TIMED)
    assert len(set(TIMED)) == len(TIMED)
    sets = legs([8, 8, 1, 4, 16])
    flat = [q for s in sets for q in s]
    assert [len(s) for s in sets] == [8, 8, 1, 4, 16] and len(set(flat)) == len(flat)
    with pytest.raises(ValueError, match="the pool has"):
        legs([len(TIMED) + 1])


def test_llama_server_row_says_why_it_is_skipped(tmp_path):
    assert "--llama-server" in llama_server.skip_reason(None)
    assert "no llama-server at" in llama_server.skip_reason(tmp_path / "absent")
    plain = tmp_path / "plain"
    plain.write_text("")
    assert "not executable" in llama_server.skip_reason(plain)
    binary, _ = fake_server(tmp_path)
    assert llama_server.skip_reason(binary) is None
    assert "GGUF" in llama_server.skip_reason(binary, gguf_known=False)


def test_llama_server_gets_token_ids_and_is_timed_then_stopped(tmp_path):
    binary, record = fake_server(tmp_path)
    server = llama_server.Server(binary, tmp_path / "model.gguf", free_port(), threads=2, parallel=8, ctx_per_slot=100)
    with server:
        timed = server.stream([1, 2, 3, 4], 5)
    assert server._proc.poll() is not None  # stopped with the block
    assert ["--parallel", "8"] == server.argv[server.argv.index("--parallel"):][:2] and "800" in server.argv
    sent = json.loads(record.read_text())
    assert sent["prompt"] == [1, 2, 3, 4] and sent["n_predict"] == 5 and sent["ignore_eos"] and sent["stream"]
    # every token event counts, its text empty or not; prompt_n says what the slot computed
    assert timed.tokens == 5 and len(timed.gaps_s) == 4 and timed.prompt_tokens == 4 and timed.cached_tokens == 2
    assert timed.ttft_s >= 0 and timed.total_s >= timed.ttft_s


def test_a_server_that_never_answers_health_fails_with_its_log(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\nprint('cannot load the model')\n")
    binary.chmod(0o755)
    with pytest.raises(RuntimeError, match="cannot load the model"):
        with llama_server.Server(binary, tmp_path / "m.gguf", free_port(), threads=1, parallel=1, ctx_per_slot=8):
            pass


def _row(system, clients, mode, tps, chunk=None):
    return {"system": system, "clients": clients, "mode": mode, "prefill_chunk": chunk, "tokens_per_s": tps,
            "requests": clients if mode != serve.SEQUENTIAL else 8, "ttft_p50_s": 1.0, "ttft_p95_s": 2.0,
            "itl_p50_s": 0.02, "itl_p95_s": 0.03, "itl_max_s": 0.5, "latency_p50_s": 3.0, "latency_p95_s": 4.0,
            "prompt_tokens_per_request": 900.0, "computed_tokens_per_request": 400.0,
            "new_questions": mode != serve.REPEATED}


def test_summary_keeps_the_best_run_and_compares_with_llama_server():
    ours, peer = serve.OURS, serve.LLAMA
    runs = [_row(ours, 1, serve.SEQUENTIAL, 20.0), _row(ours, 1, serve.SEQUENTIAL, 25.0),
            _row(ours, 8, serve.CONCURRENT, 40.0), _row(ours, 8, serve.CONCURRENT, 50.0),
            _row(peer, 1, serve.SEQUENTIAL, 10.0), _row(peer, 8, serve.CONCURRENT, 12.5),
            _row(ours, 8, serve.REPEATED, 90.0)]
    out = serve._summary(runs, 2, (None,), "corpus", None)
    assert out["speedup_8_concurrent_vs_sequential"] == 2.0
    assert out["x_llama_server"] == {serve.SEQUENTIAL: 2.5, "8 at once": 4.0}
    assert [(r["system"], r["mode"]) for r in out["rows"]] == [
        (ours, serve.SEQUENTIAL), (ours, serve.CONCURRENT), (ours, serve.REPEATED), (peer, serve.SEQUENTIAL),
        (peer, serve.CONCURRENT)]
    text = "\n".join(serve.markdown(out))
    assert "2.00x tokens/s (whole prefills)" in text and "8 at once 4.00x" in text and "400 / 900" in text
    skipped = serve._summary(runs[:4], 2, (None,), "corpus", "no llama-server given (--llama-server PATH)")
    assert "x_llama_server" not in skipped
    assert "llama-server: not run (no llama-server given" in "\n".join(serve.markdown(skipped))


def test_rows_and_tables_name_an_admission_other_than_the_default():
    runs = [_row(serve.OURS, 1, serve.SEQUENTIAL, 20.0) | {"admission": None},
            _row(serve.OURS, 8, serve.CONCURRENT, 50.0) | {"admission": "one"}]
    out = serve._summary(runs, 1, (None,), "corpus", "skipped", "one")
    assert out["admission"] == "one"
    text = "\n".join(serve.markdown(out))
    assert "2.50x tokens/s (whole prefills, admission one)" in text and "| whole, admission one |" in text
    assert serve._line(runs[1]).startswith("serve, rag-promptcache, 8 at once, whole prefills, admission one:")
    default = serve._summary(runs[:1] + [runs[1] | {"admission": "all"}], 1, (None,), "corpus", "skipped")
    assert default["admission"] == "all" and "admission" not in "\n".join(serve.markdown(default))


@pytest.mark.slow
def test_the_scenario_times_new_questions_and_the_peer_on_our_token_ids(smollm, tmp_path, monkeypatch):
    from rag_promptcache.bench import llamacpp
    from rag_promptcache.bench.common import Bench, BenchConfig
    from rag_promptcache.rag import sample

    model, tokenizer = smollm
    docs = [sample.SampleDocument("The pass statement does nothing. It is a placeholder.", {"source": "pydoc_data.topics/pass"}),
            sample.SampleDocument("A for loop runs its body once per item; break leaves it.", {"source": "pydoc_data.topics/for"}),
            sample.SampleDocument("The yield statement makes a function a generator.", {"source": "pydoc_data.topics/yield"})]
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sample, "sample_documents", lambda names=sample.TOPICS: docs)
    monkeypatch.setattr(serve, "MAX_TOKENS", 3)
    monkeypatch.setattr(serve, "MAX_BATCH", 2)
    monkeypatch.setattr(serve, "WARM", WARM[:2])
    monkeypatch.setattr(serve, "TIMED", TIMED[:5])  # 2 repeats of 2 at once, 1 alone: all five new
    monkeypatch.setattr(llamacpp, "default_ggufs", lambda: {"bf16": tmp_path / "model.gguf"})
    binary, record = fake_server(tmp_path)
    bench = Bench(model, tokenizer, "smollm2-135m-instruct", BenchConfig(), log=lambda _: None)
    out = serve.run(bench, levels=(1,), repeats=2, llama_server=binary)
    by = {(r["system"], r["mode"], r["clients"]) for r in out["runs"]}
    assert (serve.OURS, serve.REPEATED, 2) in by and (serve.LLAMA, serve.CONCURRENT, 1) in by
    for r in out["runs"]:
        if r["system"] == serve.OURS and r["mode"] != serve.REPEATED:  # a new question computes its own tokens
            assert r["computed_tokens_per_request"] > 0 and r["tokens"] == 3 * r["requests"]
    repeated = next(r for r in out["runs"] if r["mode"] == serve.REPEATED)
    new = [r for r in out["runs"] if (r["system"], r["mode"], r["clients"]) == (serve.OURS, serve.CONCURRENT, 2)][-1]
    # the same questions again: the prefix cache gives what their cached plans computed (a plan the cost
    # model sends to full prefill reuses nothing, so this is not always all of it)
    assert repeated["prompt_tokens_per_request"] == new["prompt_tokens_per_request"]
    assert repeated["computed_tokens_per_request"] <= new["computed_tokens_per_request"]
    # llama-server got token ids: as many as our server's prompt for the same question
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(isinstance(t, int) for body in sent for t in body["prompt"])
    # as ours, llama-server times the one-at-a-time and the concurrent legs of a pair in servers of their
    # own: no server's prompt cache holds a timed question it was sent before (warm-ups take 1 token)
    timed = [(body["port"], tuple(body["prompt"])) for body in sent if body["n_predict"] > 1]
    assert len({port for port, _ in timed}) == 2 and len(set(timed)) == len(timed)
    first, peer = out["runs"][:2]  # the first repeat's one-at-a-time legs: the same questions, ours then the peer's
    assert (first["system"], peer["system"]) == (serve.OURS, serve.LLAMA)
    assert first["prompt_tokens_per_request"] == peer["prompt_tokens_per_request"]
    assert set(out["x_llama_server"]) == {serve.SEQUENTIAL, "2 at once", "1 at once"}
