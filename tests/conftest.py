"""Shared fixtures: the real SmolLM2 (loaded once per session) and tiny random-weight models."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

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

REDIS_BIN = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server():
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis():
    """A server this test may kill and restart."""
    if REDIS_BIN is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()
