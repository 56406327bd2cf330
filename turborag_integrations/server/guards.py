"""What a request must pass before the app reads it: the API key, and the size of its body.

Both are ASGI middleware, so that a refused request costs neither a parse nor a read of its
body, and both answer in OpenAI's error shape:

- `RequireKey`: with a key set, every /v1/ request needs `Authorization: Bearer <key>` (401
  otherwise). /health and /metrics stay open, for load balancers and scrapers.
- `LimitBody`: a body over `max_bytes` is a 413, refused on its Content-Length header before a
  byte of it is read, or, sent without one (chunked), as soon as what has arrived exceeds it.
  A body within the limit is read whole here and handed on as one message.
"""

from __future__ import annotations

import hmac

from .responses import APIError

PROTECTED_PREFIX = "/v1/"


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class RequireKey:
    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty: pass a key, or none to serve without one")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        message = ("no API key: send it as `Authorization: Bearer <key>` (api_key= in OpenAI "
                   "clients)" if given is None else "the API key is not this server's")
        error = APIError(401, message, code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


class LimitBody:
    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError("max_bytes must be ≥ 1")
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        # Connection: close, because the rest of the body is not read.
        return APIError(413, f"the request body is larger than this server takes "
                        f"({self.max_bytes:,} bytes)", code="request_too_large",
                        headers={"Connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            if not declared.isdigit():
                error = APIError(400, "the Content-Length header is not a number",
                                 code="invalid_content_length", headers={"Connection": "close"})
            else:
                error = self._too_large()
            return await error.response()(scope, receive, send)

        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app hears it
                first = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._too_large().response()(scope, receive, send)
            parts.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)
