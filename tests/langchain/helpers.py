"""Small builders shared by the LangChain adapter tests."""

from __future__ import annotations

from pathlib import Path

from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate

SAMPLE_DOCS = Path(__file__).resolve().parents[2] / "turborag_integrations" / "data" / "sample_docs"

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only the context."),
    ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
])


def sample_paragraphs(limit: int | None = None) -> list[Document]:
    """Paragraphs of the bundled sample documents, as LangChain documents."""
    docs = []
    for path in sorted(SAMPLE_DOCS.glob("*.md")):
        for para in path.read_text().split("\n\n"):
            para = para.strip()
            if len(para) > 120:
                docs.append(Document(page_content=para, metadata={"source": path.name}))
    return docs[:limit]


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def truncate_docs(docs: list[Document], chars: int = 80) -> str:
    """A formatter that rewrites document text: the prompt holds no document verbatim."""
    return "\n\n".join(d.page_content[:chars] + "…" for d in docs)
