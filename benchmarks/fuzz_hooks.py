"""Checks schemathesis runs against our server besides its own, loaded by its CLI through
`SCHEMATHESIS_HOOKS=benchmarks.fuzz_hooks` (benchmarks/soak.py `fuzz_server`).

- `stream_ends_well`: a stream read to its end ends with "[DONE]", and none of its events is an error
  (an answer that failed after its 200 was sent says so in the stream: the status cannot). A stream the
  fuzzer stopped reading (its event limit, schemathesis' `max-stream-events`) is a client gone mid-answer:
  the checks after it show whether the server minded.
- `StillAnswers`: after the run, `/health` answers 200 within a few seconds: nothing the fuzzer sent
  stopped the server.
- `map_case`: the one rule of a chat request its schema cannot state (JSON Schema has no "last item"):
  the last message is the user's question, with text. A valid case that breaks it gets a question
  appended, so that valid cases reach retrieval and generation instead of that one 400. With
  $RAG_PROMPTCACHE_FUZZ_MAX_TOKENS set, valid cases ask for at most that many tokens (`bench --scenarios
  fuzz` on the default model, whose window would let one case decode for many minutes).

Schemathesis' own checks cover the rest: no 5xx, statuses, content types, headers and bodies as the
schema documents them (stream events included), bad data refused with a 4xx, a key required where the
schema says so, and a request that does not answer within `--request-timeout` fails.
"""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlsplit

import requests
import schemathesis

HEALTH_TIMEOUT_S = 10


def _plain_lambda_description(f: object) -> str:
    return "lambda"


# Python before 3.11.8 can fail `ast.parse` with "SystemError: AST constructor recursion depth mismatch"
# (CPython gh-106905) deep in a stack, where schemathesis' coverage phase builds the chat schema's
# strategies: Hypothesis parses a lambda's source file only to print the lambda, so it is described
# plainly instead (its own fallback's words), and the run goes on.
if sys.version_info < (3, 11, 8):
    from hypothesis.internal import lambda_sources

    lambda_sources.lambda_description = _plain_lambda_description
QUESTION = {"role": "user", "content": "What colour is the zorblat?"}
MAX_TOKENS_ENV = "RAG_PROMPTCACHE_FUZZ_MAX_TOKENS"  # set: valid cases ask for at most this many tokens


@schemathesis.hook
def map_case(ctx: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    body, meta = case.body, case.meta
    if (ctx.operation is None or meta is None or meta.generation.mode != schemathesis.GenerationMode.POSITIVE
            or not isinstance(body, dict)):
        return case
    if ctx.operation.path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        last = body["messages"][-1] if body["messages"] else None
        if not (isinstance(last, dict) and last.get("role") == "user" and _text(last.get("content")).strip()):
            body = {**body, "messages": [*body["messages"], QUESTION]}
    cap = int(os.environ.get(MAX_TOKENS_ENV, "0"))
    if cap and ctx.operation.path in ("/v1/chat/completions", "/v1/completions"):
        # a model whose window allows thousands of tokens: the answers' length is the soak's business
        body = {**body, **{f: min(body.get(f) or cap, cap) for f in ("max_tokens", "max_completion_tokens")
                           if f in body or f == "max_tokens"}}
    if body is not case.body:
        case.body = body
    return case


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@schemathesis.check
def stream_ends_well(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                     case: schemathesis.Case) -> bool | None:
    kind = response.headers.get("content-type", [""])[0]
    if not kind.startswith("text/event-stream"):
        return None
    data = [line[5:].strip() for line in response.content.decode("utf-8", "replace").splitlines()
            if line.startswith("data:")]
    for item in data:
        if item.startswith("{") and "error" in json.loads(item):
            raise AssertionError(f"the stream carried an error: {item}")
    if not response.stream_cut_short and (not data or data[-1] != "[DONE]"):
        raise AssertionError(f"the stream ended without [DONE]; its last data: {data[-1:]}")
    return True


@schemathesis.check
class StillAnswers:
    """The server answers `/health` once the run is over."""

    def __init__(self) -> None:
        self.base: str | None = None

    def after_response(self, ctx: schemathesis.CheckContext, response: schemathesis.Response,
                       case: schemathesis.Case) -> bool | None:
        url = urlsplit(response.request.url)
        self.base = f"{url.scheme}://{url.netloc}"
        return None

    def after_run(self, ctx: schemathesis.CheckContext) -> None:
        if self.base is None:
            return
        try:
            status = requests.get(f"{self.base}/health", timeout=HEALTH_TIMEOUT_S).status_code
        except requests.RequestException as e:
            raise AssertionError(f"the server stopped answering: /health: {e}") from e
        if status != 200:
            raise AssertionError(f"the server's /health answered {status} after the run")
