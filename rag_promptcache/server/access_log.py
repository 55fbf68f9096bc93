"""One access-log line per request: method, route, status, request id, prompt / cached / generated tokens,
TTFT and total time, as text or as one JSON object, on the `rag_promptcache.server.access` logger.

A pure ASGI middleware, added outermost, so it sees every response: a 401 from `RequireKey`, a 400
from validation, a 500, and a stream, which it logs when the last byte is sent. It gives each request an
id (`x-request-id` on the response; a 500's body names the same id) and reads the token counts from the
`Result` a route leaves on `request.state.handle`. It never logs headers (the API key), the query
string or the body (the prompt). `configure` sets the level and format of the server's loggers.
Not here: what a route does (`app.py`), log shipping or rotation (use the process manager's).
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS = logging.getLogger("rag_promptcache.server.access")
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        rid = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            handle = state.get("handle")
            result = getattr(handle, "result", None)
            record = {"method": scope["method"], "route": scope["path"], "status": status or 500, "request_id": rid,
                      "prompt_tokens": getattr(result, "prompt_tokens", None),
                      "cached_tokens": getattr(result, "cached_tokens", None),
                      "generated_tokens": None if result is None else result.num_generated,
                      "ttft_s": None if result is None else round(result.ttft_s, 4),
                      "total_s": round(time.perf_counter() - t0, 4)}
            ACCESS.info("%s", _Line(record))


class _Line:
    """Formatted when the handler writes it, as text or JSON (`configure`)."""

    as_json = False

    def __init__(self, record: dict[str, object]) -> None:
        self.record = record

    def __str__(self) -> str:
        r = self.record
        if self.as_json:
            return json.dumps(r)
        tokens = "" if r["prompt_tokens"] is None else (
            f" prompt={r['prompt_tokens']} cached={r['cached_tokens']} generated={r['generated_tokens']} "
            f"ttft={r['ttft_s']:.3f}s")
        return f"{r['method']} {r['route']} {r['status']} id={r['request_id']}{tokens} total={r['total_s']:.3f}s"


def configure(level: str = "info", fmt: str = "text") -> None:
    """Level and format of the server's loggers (`rag_promptcache.server`, its access log, uvicorn's errors)."""
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; valid: {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; valid: {', '.join(FORMATS)}")
    _Line.as_json = fmt == "json"
    server = logging.getLogger("rag_promptcache.server")
    server.setLevel(level.upper())
    if not server.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter() if fmt == "json" else
                             logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        server.addHandler(handler)
    logging.getLogger("uvicorn.error").setLevel(level.upper())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, and the message's fields (an access line's) or text."""

    def format(self, record: logging.LogRecord) -> str:
        line = record.args[0] if isinstance(record.args, tuple) and record.args else None
        fields = line.record if isinstance(line, _Line) else {"message": record.getMessage()}
        out = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name, **fields}
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out)
