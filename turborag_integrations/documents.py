"""The documents a workspace ingests: which files under a path, and the text of each.

Plain text (.txt, .md, .markdown, .rst) as it is, HTML as the text of its elements (scripts and
styles dropped, a paragraph break at each block), PDF through pypdf when it is installed.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from typing import Iterable

from .core.errors import TurboRAGError

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst"}
HTML_SUFFIXES = {".html", ".htm"}


class DocumentError(TurboRAGError):
    """A path names no readable document (missing, empty folder, unsupported type)."""


class UndecodableDocument(DocumentError):
    """A file named as text that is not text (binary content, another encoding): ingestion
    skips it with a warning rather than chunking noise for minutes."""


def _text(path: Path) -> str:
    """A text file's content as UTF-8; an UndecodableDocument if it holds NUL bytes (binary)
    or more than 1% of bytes that are not UTF-8 (a few stray ones are replaced)."""
    data = path.read_bytes()
    if b"\0" in data[:65536]:
        raise UndecodableDocument(f"{path}: binary content, not text; skipped")
    text = data.decode("utf-8", errors="replace")
    if text.count("\ufffd") > max(8, len(data) // 100):
        raise UndecodableDocument(f"{path}: not UTF-8 text (convert it to UTF-8); skipped")
    return text


class _TextOfHTML(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("p", "br", "div", "li", "h1", "h2", "h3", "h4", "tr"):
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def read_document(path: Path) -> str:
    """Text of a .txt/.md/.rst, .html or (with pypdf installed) .pdf file."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return _text(path)
    if suffix in HTML_SUFFIXES:
        parser = _TextOfHTML()
        parser.feed(_text(path))
        return "".join(parser.parts)
    if suffix == ".pdf":
        try:
            from pypdf import PdfReader
        except ImportError:
            raise DocumentError(f"{path}: reading PDF needs `pip install pypdf`") from None
        return "\n\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    raise DocumentError(f"{path}: unsupported file type {suffix!r}")


def find_documents(paths: Iterable[str | Path]) -> list[Path]:
    """Files to ingest under the given files and folders; a bad path is an error."""
    readable = TEXT_SUFFIXES | HTML_SUFFIXES | {".pdf"}
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise DocumentError(f"no such file or folder: {p}")
        if p.is_dir():
            found += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in readable
                            and not any(part.startswith(".") for part in f.parts))
        else:
            found.append(p)
    if not found:
        raise DocumentError("no readable documents (.txt, .md, .rst, .html, .pdf) under "
                             + ", ".join(map(str, paths)))
    return found
