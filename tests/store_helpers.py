"""Helpers shared by the store tests: a real redis-server on a free loopback port, and random ModuleKVs."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from rag_promptcache.store import ModuleKV, module_key

REDIS_BIN = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int, *extra: str) -> None:
        self.port = port
        self.extra = extra  # more redis-server arguments, e.g. "--maxmemory", "1mb"
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *self.extra]
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



needs_redis = pytest.mark.skipif(REDIS_BIN is None, reason="redis-server binary not found (apt-get install redis-server)")


def make_kv(seed: int, num_tokens: int = 16, fingerprint: str = "model-a", shape=(2, 2, 8)) -> ModuleKV:
    g = torch.Generator().manual_seed(seed)
    L, H, D = shape
    keys = torch.randn(L, H, num_tokens, D, generator=g)
    values = torch.randn(L, H, num_tokens, D, generator=g)
    token_ids = tuple(range(seed, seed + num_tokens))
    return ModuleKV(keys, values, start=seed % 7, token_ids=token_ids, fingerprint=fingerprint, mode="alone")


def key_of(kv: ModuleKV) -> str:
    return module_key(kv.fingerprint, kv.mode, kv.token_ids, kv.start)
