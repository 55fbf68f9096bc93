"""eval --byproduct on a fidelity split, through the CLI as a user runs it, at each k.
python run.py SPLIT N OUT K... (RPC_SEED_OFFSET=1: the second draw)"""
import json, os, sys, subprocess, tempfile, time
from pathlib import Path
from rag_promptcache.bench import fidelity as bf
from rag_promptcache.rag import Corpus

split, n, out, ks = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
out.mkdir(parents=True, exist_ok=True)
seed = int(os.environ.get("RPC_SEED_OFFSET", "0"))
data, chunk = bf.split_data(split, seed_offset=seed)
split = split + (f"-draw{seed}" if seed else "")
tmp = Path(tempfile.mkdtemp(prefix="byp-eval-"))
c = Corpus.build(data.documents, tmp / "corpus", chunk_tokens=chunk, progress=False, dtype="bfloat16")
c.close()
qs = out / f"{split}-questions.jsonl"
qs.write_text("".join(json.dumps({"question": q.question, "answer": q.answer}) + "\n" for q in data.questions[:n]))
for k in ks:
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "rag_promptcache.cli", "eval", str(qs), "--corpus", str(tmp / "corpus"),
                        "--byproduct", "-k", k, "--recovery", "none,last:1", "--dtype", "bfloat16", "--json"],
                       capture_output=True, text=True)
    (out / f"{split}-k{k}.json").write_text(r.stdout + r.stderr)
    print(split, k, r.returncode, f"{time.time() - t:.0f} s", r.stderr[-1000:], flush=True)
