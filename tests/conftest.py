"""Shared fixtures: the real SmolLM2 (loaded once per session) and tiny random-weight models."""

from __future__ import annotations

import pytest
import torch

from tests.store_helpers import REDIS_BIN, RedisServer, free_port

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the default model, SmolLM2-135M-Instruct, fp32 on CPU."""
    from rag_promptcache.model.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="session")
def tokenizer(smollm):
    return smollm[1]


# -- a real redis-server, started by the tests that need one --------------------------------------

def _serve():
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    yield from _serve()


@pytest.fixture
def own_redis():
    """A server this test may kill and restart."""
    yield from _serve()
