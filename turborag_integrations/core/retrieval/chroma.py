"""Chroma clients for the vector stores and the workspace: embedded in a folder, or a server's.

    chroma_client(path="./chroma")                  # embedded and persistent: no server
    chroma_client(url="http://127.0.0.1:8200")      # a server started with `chroma run`

The embedded client keeps its index in a SQLite file meant for one process at a time; a server
(`chroma run --path ./chroma --port 8200`) lets several processes share one index: the command
line, a web app, a notebook.

Chroma's HTTP client waits without a time limit for a server that does not answer, and reports
a refused connection only as "Are you sure it is running?". So `chroma_client` first asks the
server for its heartbeat, with a timeout, and fails with the URL and the command that starts a
server.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from ..errors import TurboRAGError

DEFAULT_PORT = 8000  # what `chroma run` listens on unless told otherwise
EXAMPLE_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
HEARTBEAT_PATH = "/api/v2/heartbeat"
CONNECT_TIMEOUT_S = 5.0


class ChromaURLError(TurboRAGError, ValueError):
    """A Chroma server URL that cannot be used (no http/https scheme, no host, a bad port...)."""


class ChromaUnreachable(TurboRAGError, ConnectionError):
    """No Chroma server answers at a URL (or what answers is not one)."""


def parse_chroma_url(url: str) -> tuple[str, int, bool]:
    """(host, port, ssl) of a URL such as `http://127.0.0.1:8000`, for `chromadb.HttpClient`.

    Without a port, http means Chroma's 8000 and https means 443.
    """
    text = url.strip()
    if "://" not in text:
        raise ChromaURLError(f"Chroma server URL {url!r} has no scheme: write it as "
                             f"http://{text} (or https://...), e.g. {EXAMPLE_URL}")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ChromaURLError(f"not a Chroma server URL: {url!r}; expected http:// or https://, "
                             f"a host and a port, e.g. {EXAMPLE_URL}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username or parts.password:
        # The client builds its own API paths and takes no credentials in the URL: anything
        # more would be silently dropped.
        raise ChromaURLError(f"Chroma server URL {url!r} has more than a scheme, host and "
                             f"port; give only those, e.g. {EXAMPLE_URL}")
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        raise ChromaURLError(f"Chroma server URL {url!r} has a bad port; e.g. "
                             f"{EXAMPLE_URL}") from None
    ssl = parts.scheme == "https"
    if port is None:
        port = 443 if ssl else DEFAULT_PORT
    return parts.hostname, port, ssl


def _start_hint(port: int) -> str:
    return (f"start one with `chroma run --path ./chroma --port {port}`, or leave the URL out "
            "to use an embedded Chroma")


def check_server(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ChromaUnreachable unless a Chroma server answers its heartbeat at `url`."""
    import httpx  # a dependency of chromadb's HTTP client

    host, port, ssl = parse_chroma_url(url)
    base = f"{'https' if ssl else 'http'}://{host}:{port}"
    try:
        response = httpx.get(base + HEARTBEAT_PATH, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ChromaUnreachable(f"no Chroma server answers at {url} ({type(exc).__name__}: "
                                f"{exc}); {_start_hint(port)}") from None
    if response.status_code != 200:
        raise ChromaUnreachable(f"something answers at {url}, but not a Chroma server (GET "
                                f"{HEARTBEAT_PATH} gave HTTP {response.status_code}); check "
                                f"the port, or {_start_hint(port)}")


def chroma_client(path: str | Path | None = None, url: str | None = None, *,
                  timeout_s: float = CONNECT_TIMEOUT_S):
    """A chromadb client: `chromadb.HttpClient` for the server at `url`, else an embedded
    `chromadb.PersistentClient` over the folder `path`.

    A server is checked before the client is made (see the module's notes): a bad URL raises
    ChromaURLError, no server there ChromaUnreachable, within `timeout_s`.
    """
    import chromadb

    if url and path is not None:
        raise ValueError("give a folder for an embedded Chroma or a Chroma server URL, not both "
                         "(a server keeps its own files: `chroma run --path DIR`)")
    if not url:
        if path is None:
            raise ValueError("an embedded Chroma needs a folder (path), or give a server URL")
        return chromadb.PersistentClient(path=str(Path(path).expanduser()))
    host, port, ssl = parse_chroma_url(url)
    check_server(url, timeout_s)
    try:
        return chromadb.HttpClient(host=host, port=port, ssl=ssl)
    except ValueError as exc:  # it answered the heartbeat, then refused tenant or database
        raise ChromaUnreachable(f"the Chroma server at {url} refused the client: {exc}") from exc
