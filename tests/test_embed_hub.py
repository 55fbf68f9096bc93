"""An embedder name that is neither local, cached nor reachable fails after one attempt to reach
the hub, as `--model` does, not after huggingface_hub's minute of retries (issue 25, item 1).

Attempts are counted at the socket (the probe and every httpx download attempt open one), so the
test neither waits for the retries nor depends on the machine's speed."""

from __future__ import annotations

import socket
import time

import huggingface_hub.constants
import pytest

from rag_promptcache.rag.embed import Embedder


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: a connect is refused at once


def test_an_unreachable_embedder_fails_after_one_attempt(monkeypatch, tmp_path) -> None:
    port = closed_port()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    attempts: list[object] = []
    connect = socket.create_connection

    def counting(address, *args, **kwargs):
        if address[1] == port:
            attempts.append(address)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counting)
    monkeypatch.setattr(time, "sleep", lambda s: None)  # a retry loop, if any, is counted, not waited for
    with pytest.raises(ValueError) as info:
        Embedder("not-an-embedder-xyz")
    assert len(attempts) == 1, attempts
    assert "cannot load embedder 'not-an-embedder-xyz'" in str(info.value) and "unreachable" in str(info.value)
    assert "all-MiniLM-L6-v2" in str(info.value)  # names what would work


@pytest.mark.parametrize("name", ["./no/such/dir", "a/b/c"])
def test_a_missing_embedder_path_fails_without_the_hub(monkeypatch, name) -> None:
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("no network for a path"))
    with pytest.raises(ValueError, match="not a sentence-transformers directory"):
        Embedder(name)
