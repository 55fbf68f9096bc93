"""An API key for every route but `/health` and the chat page's HTML: `Authorization: Bearer <key>`.

A pure ASGI middleware, so streaming responses and disconnect detection pass through untouched.
The page at `/` is served without the key because it asks for the key itself; every `/v1/*` call it
makes carries it. A missing or wrong key is a 401 in OpenAI's error shape. Keys are compared with
`hmac.compare_digest`, so the time taken says nothing about how much of a guess matched.
Not here: several keys, scopes, rate limits per key (put a reverse proxy in front).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from rag_promptcache.server import responses as r

OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico"})


class RequireKey:
    def __init__(self, app: ASGIApp, key: str) -> None:
        if not key:
            raise ValueError("the API key is empty; pass a non-empty --api-key or leave it unset")
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send the header 'Authorization: Bearer <key>'" if given is None else
                   "incorrect API key provided")
        body = json.dumps(r.error(message, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
