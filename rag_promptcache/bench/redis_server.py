"""A redis-server of the bench's own, on a free loopback port, for a scenario's shared tier.

    with LocalRedis("--maxmemory", "64mb") as server:
        store = RedisStore(server.url)

Nothing is saved (no RDB, no AOF), and the process is killed on exit. `stop()` and `start()` take it
down and bring it back, empty, on the same port (the tests' outages). Not here: a server the user runs
(`--redis-url` where a scenario takes one), installing redis-server (`make redis`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

INSTALL_HINT = "redis-server not found on PATH (make redis, or apt-get install redis-server)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed() -> bool:
    return shutil.which("redis-server") is not None


class LocalRedis:
    def __init__(self, *extra: str, start_timeout_s: float = 10.0) -> None:
        """`extra`: more redis-server arguments, e.g. "--maxmemory", "64mb"."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                      *extra]
        self._timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalRedis:
        """Start the server and wait until it answers PING."""
        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {self._timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
