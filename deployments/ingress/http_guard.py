"""The ingress's first line: a request body is JSON, of bounded size and depth, before any
parsing or validation runs.

:class:`BodyGuard` is a pure ASGI middleware on the FastAPI app. For every ``POST`` with a body:

- a ``Content-Type`` other than JSON is a **415** (a ``POST`` with no body and no
  ``Content-Type`` passes: the route says whether it needs one);
- a body above ``max_body_bytes`` is a **413**, decided from ``Content-Length`` at once or
  while the body streams in (nothing more is read);
- a body that is not UTF-8, not JSON, or nested deeper than ``max_json_depth`` is a **400**
  saying which (Python's parser would otherwise recurse until it fails).

Every refusal is OpenAI's error envelope. The body read here is handed on unchanged, so the
route parses it as usual. Limits are set once per ingress replica by :func:`configure` (or
given to the middleware).
"""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]

#: the limits in force (one ingress per process; :func:`configure` sets them)
LIMITS = {"max_body_bytes": 16 * 1024 * 1024, "max_json_depth": 64}


def configure(max_body_bytes: int, max_json_depth: int) -> None:
    LIMITS["max_body_bytes"] = max_body_bytes
    LIMITS["max_json_depth"] = max_json_depth


def json_depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in o)
    return deepest


def _error_body(message: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
    ).encode()


class BodyGuard:
    """See the module docstring; ``app`` is the wrapped ASGI app."""

    def __init__(
        self, app: Any, max_body_bytes: int | None = None, max_json_depth: int | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        bodyless = headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers
        if not ctype and bodyless:  # a POST with no body (an operator's reset): nothing to check
            await self.app(scope, receive, send)
            return
        if ctype != "application/json" and not ctype.endswith("+json"):
            await _refuse(
                send, 415, f"Content-Type must be application/json, not {ctype or 'none'!r}"
            )
            return
        limit = self.max_body_bytes or LIMITS["max_body_bytes"]
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, f"the body has {declared} bytes; the limit is {limit}")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                await _refuse(send, 413, f"the body is above the limit of {limit} bytes")
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        raw = b"".join(chunks)
        problem = _check_json(raw, self.max_json_depth or LIMITS["max_json_depth"])
        if problem is not None:
            await _refuse(send, 400, problem)
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # after the body: the client's disconnect, if any

        await self.app(scope, replay, send)


def _check_json(raw: bytes, max_depth: int) -> str | None:
    """Why ``raw`` is not an acceptable JSON body, or None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the body is not valid UTF-8 (byte {e.start})"
    if not text.strip():
        return "the body is empty; expected a JSON object"
    if text.count("[") + text.count("{") <= max_depth:
        return None  # cannot be too deep; the route parses it
    try:
        obj = json.loads(text)
    except RecursionError:
        return f"the JSON body is nested deeper than {max_depth} levels"
    except ValueError:
        return None  # the route's parser reports where the JSON is malformed
    if json_depth(obj) > max_depth:
        return f"the JSON body is nested deeper than {max_depth} levels"
    return None


async def _refuse(send: Any, status: int, message: str) -> None:
    body = _error_body(message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
