"""How `serve` starts and stops: the port bound before anything is announced, and a shutdown that says
what it does.

`bind` turns a port in use into one ValueError line (the CLI's exit 1) before the model loads.
`GracefulServer` is uvicorn's server with its signal handling replaced: on SIGTERM or SIGINT it says on
stderr how many requests are running, lets uvicorn refuse new connections and wait for open ones up
to `timeout_graceful_shutdown` (then cancel them), and returns instead of re-raising the signal, so
the caller picks the exit code. Not here: what runs (`serve` in `__init__.py`).
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from rag_promptcache.engine.batching.batcher import Batcher


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), or a ValueError naming the problem in one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a recent TIME_WAIT is no conflict
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = ("the port is in use; stop the other server or pick another --port" if e.errno == errno.EADDRINUSE
               else e.strerror or str(e))
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from e
    return sock


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, batchers: list[Batcher], say: Callable[[str], None]) -> None:
        super().__init__(config)
        self.batchers, self.say = batchers, say
        self.signals: list[int] = []  # received, in order
        self.cancelled = False  # whether the timeout passed with requests still open

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        start = time.monotonic()
        await super().shutdown(sockets)
        timeout = self.config.timeout_graceful_shutdown
        self.cancelled = timeout is not None and time.monotonic() - start >= timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.signals:
            running, waiting = sum(b.num_running for b in self.batchers), sum(b.num_waiting for b in self.batchers)
            self.say(f"received {signal.Signals(sig).name}: refusing new connections; {running} running and "
                     f"{waiting} waiting request(s) get {self.config.timeout_graceful_shutdown:g} s to finish, "
                     "then are cancelled")
        self.signals.append(sig)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the signal once shut down (SIGTERM: exit 143, no message)
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
