"""What goes to a lent GPU machine fits a call: the device tool sends the working tree plus the paths a
call carries, 64 MiB in all (scripts/travel.py). `make gpu-check` carries its wheels beside the tree,
and `scripts/tune_on_gpu.sh` sends the 98 MB model in parts over calls to one warm machine and joins
them there. Both are prepared here and run where no test runs, so what can be checked without a GPU is
checked here: the tree leaves room, the device benches need no FAISS wheel, and the parts staged call
by call join into the file that was split."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import travel  # noqa: E402

# `make gpu-wheels` carries 16.3 MiB (transformers, pytest-asyncio, the tokenizer); a tune call carries
# a model part as large as the room left. Under this, every prepared call keeps over 20 MiB to carry.
TREE_BUDGET = 40 * 2**20


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_tree_leaves_room_for_what_the_device_calls_carry():
    tree = travel.tree_bytes(ROOT)
    assert tree <= TREE_BUDGET, (
        f"the tree is {tree / 2**20:.1f} MiB: every device call carries it (64 MiB in all with what it names); "
        f"keep large results out of the repository or make gpu-check and tune_on_gpu.sh carry less")
    assert travel.room(ROOT) >= travel.LIMIT - travel.MARGIN - TREE_BUDGET


def test_the_device_tier_and_benches_import_without_faiss():
    # gpu-check carries no FAISS wheel: its tests and benches must not import it (rag/index.py imports
    # it when an index is made). The blocked import must still fail where an index is built.
    code = """
import sys
sys.modules["faiss"] = None  # any `import faiss` raises ImportError
import rag_promptcache.rag, rag_promptcache.bench, rag_promptcache.bench.cli, benchmarks.shape
import rag_promptcache.bench.ttft, rag_promptcache.bench.decode, rag_promptcache.cli.app
for name in ("test_engine", "test_positions", "test_recovery", "test_chunked_prefill", "test_batch",
             "test_attention", "test_graphs", "test_stream", "test_device_store"):
    __import__(f"tests.{name}")
from rag_promptcache.rag import VectorIndex
try:
    VectorIndex(8)
except ImportError:
    print("blocked where an index is made")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "blocked where an index is made" in out.stdout


def test_gpu_wheels_checks_that_what_it_carries_fits(tmp_path):
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "big.whl").write_bytes(b"\0" * (3 * 2**20))
    run = lambda limit: subprocess.run(  # noqa: E731
        [sys.executable, "scripts/travel.py", "--carry", str(tmp_path / "whl"), "--limit-mib", str(limit)],
        cwd=ROOT, capture_output=True, text=True)
    tree = travel.tree_bytes(ROOT) / 2**20
    fits, over = run(tree + 6), run(tree + 4)  # 3 MiB carried, 2 MiB kept spare
    assert fits.returncode == 0 and "left" in fits.stdout
    assert over.returncode == 1 and "carry less or shrink the tree" in over.stderr


def _git_tree(path: Path, size: int) -> Path:
    path.mkdir()
    (path / "tracked.bin").write_bytes(os.urandom(size))
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run(["git", "add", "tracked.bin"], cwd=path, check=True)
    return path


def test_the_model_travels_in_parts_that_each_fit_a_call_and_join_on_the_device(tmp_path):
    root = _git_tree(tmp_path / "repo", 300_000)
    gpu = tmp_path / "gpu"
    (gpu / "c1" / "tok").mkdir(parents=True)
    (gpu / "c1" / "tok" / "tokenizer.json").write_bytes(b"{}" * 100_000)  # 200 kB already in the first call
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(2_500_000))
    limit = 1_300_000  # each call: the 300 kB tree, then 1 MB
    parts = travel.split(model, gpu, root, limit=limit, margin=0)
    assert [p.relative_to(gpu).as_posix() for p in parts] == ["c1/part_1", "c2/part_2", "c3/part_3"]
    assert parts[0].stat().st_size == 800_000 and parts[1].stat().st_size == 1_000_000
    for i in (1, 2, 3):
        assert travel.tree_bytes(root) + travel.path_bytes(gpu / f"c{i}") <= limit
    assert b"".join(p.read_bytes() for p in parts) == model.read_bytes()
    (gpu / "c1" / "parts").write_text("3\n")
    (gpu / "c1" / "model.sha256").write_text(hashlib.sha256(model.read_bytes()).hexdigest() + "\n")

    stage = tmp_path / "stage"

    def call(verb: str, carried: int, *args: str) -> subprocess.CompletedProcess:
        # one device call: only the folder it carries is there
        here = tmp_path / f"call{carried}"
        shutil.rmtree(here, ignore_errors=True)
        shutil.copytree(gpu / f"c{carried}", here / f"c{carried}")
        env = {**os.environ, "GPU_DIR": str(here), "STAGE": str(stage), "TUNE_DRY": "1", "DEVICE": "cpu",
               "PY": sys.executable, "OUT": str(tmp_path / "out")}
        return subprocess.run(["bash", "scripts/tune_on_gpu.sh", verb, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True)

    early = call("train", 2, "60")  # the second part alone, before the first call
    assert early.returncode == 3 and "nothing staged" in early.stdout
    shutil.rmtree(stage)
    assert call("stage", 1).returncode == 0
    missed = call("train", 3, "60")  # the middle call was missed
    assert missed.returncode == 3 and "part_2 is not here" in missed.stdout
    assert call("stage", 2).returncode == 0
    done = call("train", 3, "60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (stage / "model" / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == model.read_bytes()
    assert ": OK" in done.stdout  # sha256sum -c
    recipe = done.stdout.strip().splitlines()[-1]
    assert "rag_promptcache.tune.recipe" in recipe and "--seconds 60" in recipe and "--device cpu" in recipe
    # the link-token recipe, from the shipped adapter, which travels in the tree
    assert "--links 4" in recipe and "--init rag_promptcache/model/adapters/smollm2-135m-instruct" in recipe
    assert (ROOT / "rag_promptcache/model/adapters/smollm2-135m-instruct/adapter_model.safetensors").is_file()


def test_a_corrupt_part_is_refused_before_training(tmp_path):
    root = _git_tree(tmp_path / "repo", 1000)
    gpu = tmp_path / "gpu"
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(50_000))
    parts = travel.split(model, gpu, root, limit=21_000, margin=0)
    (gpu / "c1" / "parts").write_text(f"{len(parts)}\n")
    (gpu / "c1" / "model.sha256").write_text(hashlib.sha256(model.read_bytes()).hexdigest() + "\n")
    parts[-1].write_bytes(parts[-1].read_bytes()[:-1] + b"x")
    env = {**os.environ, "GPU_DIR": str(gpu), "STAGE": str(tmp_path / "stage"), "TUNE_DRY": "1",
           "PY": sys.executable, "OUT": str(tmp_path / "out")}
    out = subprocess.run(["bash", "scripts/tune_on_gpu.sh", "train", "60"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
    assert "rag_promptcache.tune.recipe" not in out.stdout


def test_sizes_says_when_prepared_calls_no_longer_fit_the_tree(tmp_path):
    # prep sizes its parts to the tree as it was; a commit after it can push a call over the limit
    (tmp_path / "c1").mkdir()
    (tmp_path / "c2").mkdir()
    (tmp_path / "c1" / "part_1").write_bytes(b"\0" * 1000)
    env = {**os.environ, "GPU_DIR": str(tmp_path), "BIN": str(Path(sys.executable).parent)}
    sizes = lambda: subprocess.run(["bash", "scripts/tune_on_gpu.sh", "sizes"], cwd=ROOT, env=env,  # noqa: E731
                                   capture_output=True, text=True)
    (tmp_path / "c2" / "part_2").write_bytes(b"\0" * 1000)
    assert sizes().returncode == 0
    (tmp_path / "c2" / "part_2").write_bytes(b"\0" * (travel.room(ROOT) + 2**20))
    over = sizes()
    assert over.returncode == 1 and "run prep again" in over.stdout


def test_a_carry_that_is_not_there_and_an_unknown_verb_are_refused_by_name(tmp_path):
    missing = subprocess.run([sys.executable, "scripts/travel.py", "--carry", str(tmp_path / "nowhere")], cwd=ROOT,
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "nowhere: missing" in missing.stderr
    verb = subprocess.run(["bash", "scripts/tune_on_gpu.sh", "check"], cwd=ROOT, capture_output=True, text=True)
    assert verb.returncode == 2 and "usage: scripts/tune_on_gpu.sh prep | sizes | stage | train SECONDS" in verb.stdout
