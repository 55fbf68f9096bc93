"""What a test process sets up once for every test directory it runs (tests/ and the two adapters'):
torch's thread count, and the default model as a user gets it.

Imported by tests/conftest.py, test_model_loading.py and the adapters' test helpers (tests/adapter_shared.py),
so that one process loads the default model once, whichever of them runs first."""

from __future__ import annotations

import functools
import os


def torch_threads() -> int:
    """Threads for torch in this test process: two, or this process's share of the cores when pytest-xdist
    runs several workers (each worker a process: two threads each on two cores would oversubscribe)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, len(os.sched_getaffinity(0)) // workers))


def set_torch_threads() -> None:
    import torch

    torch.set_num_threads(torch_threads())


@functools.cache
def default_smollm():
    """(model, tokenizer) from `load_model()`: the default alias with its defaults (bf16 where the CPU has
    bf16 units, the shipped adapter), from the default cache location. Tests only read it: the loading
    tests check it, the adapters' tests wrap it in their engine (`adapter_shared.engine`)."""
    from rag_promptcache.model.loading import load_model

    return load_model()
