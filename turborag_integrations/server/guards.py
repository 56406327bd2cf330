"""What a request must pass before the app reads it: the API key, and the size of its body.

Both are ASGI middleware, so that a refused request costs neither a parse nor a read of its
body, and both answer in OpenAI's error shape:

- `Authenticate`: with a key (or a keys file of tenants' keys, keys.py) set, every /v1/ request
  needs `Authorization: Bearer <key>` (401 otherwise) and is tagged with its tenant. /health
  stays open for load balancers; /metrics too, except with tenants, whose figures it holds.
- `LimitBody`: a body over `max_bytes` is a 413, refused on its Content-Length header before a
  byte of it is read, or, sent without one (chunked), as soon as what has arrived exceeds it.
  A body within the limit is read whole here and handed on as one message; one that has not
  arrived whole within `timeout_s` is a 408 (a client that dribbles it holds its connection,
  not the server).
"""

from __future__ import annotations

import asyncio
import hmac
import time

from .keys import KeyFile, Principal
from .responses import APIError

PROTECTED_PREFIX = "/v1/"


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class Authenticate:
    """Who sends each request: with `api_key`, the one key of a server without tenants; with
    `keys` (a `KeyFile`), the tenant of the key sent. The principal goes into the request's
    state (`request.state.principal`) for the app, and into the metrics.

    /v1/ paths need a key (401 otherwise, the same answer for a key never issued and a revoked
    one). With a keys file, /metrics needs an admin key (403 for another tenant's key): its
    figures are every tenant's. /health stays open, and says nothing about anyone's data.
    """

    def __init__(self, app, *, api_key: str | None = None, keys: KeyFile | None = None):
        if (api_key is None) == (keys is None):
            raise ValueError("authenticate with one API key or with a keys file")
        if api_key is not None and not api_key:
            raise ValueError("the API key is empty: pass a key, or none to serve without one")
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self._keys = keys

    def _principal(self, given: bytes) -> Principal | None:
        if self._expected is not None:
            return Principal("", admin=True) if hmac.compare_digest(given, self._expected) \
                else None
        scheme, _, key = given.partition(b" ")
        if scheme != b"Bearer" or not key:
            return None
        return self._keys.lookup(key.decode("latin-1"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        metrics = path == "/metrics" and self._keys is not None
        if not (path.startswith(PROTECTED_PREFIX) or metrics):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization")
        principal = None if given is None else self._principal(given)
        if principal is None:
            message = ("no API key: send it as `Authorization: Bearer <key>` (api_key= in OpenAI "
                       "clients)" if given is None else "the API key is not valid here")
            error = APIError(401, message, code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
        elif metrics and not principal.admin:
            error = APIError(403, "/metrics holds every tenant's figures: it needs an admin key "
                             "(turborag keys add NAME --admin)", code="forbidden")
        else:
            scope.setdefault("state", {})["principal"] = principal
            return await self.app(scope, receive, send)
        await error.response()(scope, receive, send)


class LimitBody:
    def __init__(self, app, max_bytes: int, timeout_s: float | None = None):
        if max_bytes < 1:
            raise ValueError("max_bytes must be ≥ 1")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError("the body timeout must be a positive number of seconds")
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

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
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            try:
                message = await (receive() if deadline is None else asyncio.wait_for(
                    receive(), max(deadline - time.monotonic(), 0)))
            except asyncio.TimeoutError:
                # a client that dribbles its body (slow loris) holds a connection, nothing more
                error = APIError(408, f"the request body did not arrive within "
                                 f"{self.timeout_s:g} s", code="request_timeout",
                                 headers={"Connection": "close"})
                return await error.response()(scope, receive, send)
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
