"""Which files a workspace ingests and the text it reads from each (documents.py)."""

from __future__ import annotations

import pytest

from turborag_integrations.core.errors import TurboRAGError
from turborag_integrations.documents import DocumentError, find_documents, read_document


def test_html_gives_the_text_of_its_elements_without_scripts_or_styles(tmp_path):
    page = tmp_path / "page.html"
    page.write_text("<html><head><style>p {color: red}</style><script>var x = 1;</script></head>"
                    "<body><h1>Ferries</h1><p>The Aldine sank in 1932.</p><p>Its bell hangs in "
                    "the town hall.</p></body></html>")
    text = read_document(page)
    assert "color" not in text and "var x" not in text
    assert [p.strip() for p in text.split("\n\n") if p.strip()] == [
        "Ferries", "The Aldine sank in 1932.", "Its bell hangs in the town hall."]


def test_folders_give_readable_files_in_order_hidden_ones_skipped(tmp_path):
    (tmp_path / "b.md").write_text("b")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "notes.txt").write_text("not a document")
    assert find_documents([tmp_path]) == [tmp_path / "a.txt", tmp_path / "b.md"]


def test_bad_paths_and_types_are_errors_that_say_what_is_wrong(tmp_path):
    with pytest.raises(DocumentError, match="no such file or folder"):
        find_documents([tmp_path / "missing"])
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DocumentError, match=r"no readable documents \(.txt, .md"):
        find_documents([tmp_path])
    with pytest.raises(DocumentError, match="unsupported file type '.png'"):
        read_document(tmp_path / "image.png")
    assert issubclass(DocumentError, TurboRAGError)  # the CLI reports it as every other error
