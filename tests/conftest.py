"""Shared fixtures: the real SmolLM2 (loaded once per session), its tokenizer alone, and redis servers.

Tiers: tests that load SmolLM2's weights are marked `smollm`, the server, bench, examples, Ray and
wheel tests `slow`; `make test-fast` runs the rest (`-m "not smollm and not slow"`). Tests that take
the `device` fixture are marked `device`: they run their tiny models on RAG_PROMPTCACHE_TEST_DEVICE
(cpu unless set), which is how `make gpu-check` runs the engine on CUDA (`-m device`)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from tests.shared_model import set_torch_threads
from tests.store_helpers import LocalRedis, installed

set_torch_threads()
# The cost model's calibrations (engine/planning/costmodel.py) made by this session, and by the commands its
# tests start, stay in a folder of its own: a calibration measured beside a busy test suite must not steer a
# user's plans, nor theirs the tests'. The code path is the default one, only the folder differs.
COSTS_DIR = tempfile.mkdtemp(prefix="rag-promptcache-test-costs-")
os.environ["RAG_PROMPTCACHE_COSTS_DIR"] = COSTS_DIR
atexit.register(shutil.rmtree, COSTS_DIR, ignore_errors=True)
# The suite runs the default path (fallback "auto", engine/planning/costmodel.py). A test that checks the cached
# path asks for it: PromptCache(..., fallback="never"). On the tiny models a cached and a full prefill take about
# as long, so which one "auto" picks follows the calibration's timing noise (a loaded machine flipped 18 tests).


TEST_DEVICE = os.environ.get("RAG_PROMPTCACHE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def device() -> str:
    """Where the `device` tests put their models: RAG_PROMPTCACHE_TEST_DEVICE, cpu unless set."""
    try:
        dev = torch.device(TEST_DEVICE)
    except RuntimeError as e:
        raise pytest.UsageError(f"RAG_PROMPTCACHE_TEST_DEVICE={TEST_DEVICE!r}: valid: cpu, cuda, cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"RAG_PROMPTCACHE_TEST_DEVICE={TEST_DEVICE!r} but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"RAG_PROMPTCACHE_TEST_DEVICE={TEST_DEVICE!r}: valid: cpu, cuda, cuda:N")
    return str(dev)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, fp32 on CPU.

    fp32 on every machine, although `auto` is bf16 on a CPU with bf16 units: the tests that use it
    hold answers to be the same token for token (cached and full prefill, hit and miss, batched and
    alone), which fp32 guarantees and bf16 only up to rounding (docs/limits.md). The bf16 default is
    tested where it is chosen (test_model_loading) and end to end (test_engine's bf16 test)."""
    from rag_promptcache.model.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups in each worker
def pytest_collection_modifyitems(config, items):
    # a test that takes the real model, directly or through another fixture, is in the smollm tier
    for item in items:
        if "smollm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.smollm)
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
    # Under pytest-xdist's `--dist loadgroup` (the Makefile's test targets) a file's tests run in one worker,
    # so its module fixtures (a server, a corpus, a Ray cluster) are made once; the files that start Ray run
    # in one worker, one after the other, as two clusters on one machine would compete for its cores; the
    # adapters' tests share one worker and so their engine (tests/adapter_shared.py).
    ray_files = {item.path for item in items if item.get_closest_marker("ray")}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = ("ray" if item.path in ray_files else "adapters" if "integrations" in item.path.parts
                     else item.nodeid.split("::")[0])
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _smollm_weights_only_where_marked(request, monkeypatch):
    """Fail a test that loads SmolLM2's weights in this process without the smollm marker, so that
    `-m "not smollm"` stays fast as tests are added. Subprocesses are not watched."""
    if request.node.get_closest_marker("smollm") is None:
        from transformers import AutoModelForCausalLM

        from rag_promptcache.model.loading import DEFAULT_MODEL

        from rag_promptcache.model import llama

        def refuse(path: object, gguf_file: object = "") -> None:
            if DEFAULT_MODEL in str(path) or "SmolLM2" in str(gguf_file):
                pytest.fail(f"{request.node.nodeid} loads SmolLM2 ({path}): mark it smollm")

        real, ours = AutoModelForCausalLM.from_pretrained.__func__, llama.load

        def guarded(cls, path, *args, **kwargs):
            refuse(path, kwargs.get("gguf_file", ""))
            return real(cls, path, *args, **kwargs)

        def guarded_ours(directory, *args, **kwargs):  # the default's merged weights load without transformers
            refuse(directory)
            return ours(directory, *args, **kwargs)

        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(guarded))

        monkeypatch.setattr(llama, "load", guarded_ours)
    yield


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (seconds, no weights): what the tiny random-weight models
    borrow for real text. Tests that need the model too take `smollm`, whose tokenizer is the same.

    RAG_PROMPTCACHE_TEST_TOKENIZER names a directory holding that tokenizer saved alone, for a
    machine without the model's wheel (`make gpu-wheels` saves one for `make gpu-check`)."""
    saved = os.environ.get("RAG_PROMPTCACHE_TEST_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    from rag_promptcache.model.loading import load_tokenizer

    return load_tokenizer()


# -- a real redis-server, started by the tests that need one --------------------------------------

def _serve():
    if not installed():
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server():
    yield from _serve()


@pytest.fixture
def own_redis():
    """A server this test may kill and restart."""
    yield from _serve()
