"""A training mix of documents: chunks that are sections of longer documents, laid out as a
stock pipeline retrieves them.

The generated mix (mix.py) is made of one-paragraph entities in templated sentences, and the
document a chunk is encoded after is made up. Deployed, a chunk is one section of a longer
document (a policy's fourth section, which names the policy only in its first), retrieved among
sections of other documents in score order, and encoded after its own document's text before it
(context encoding, core/prefill/context.py). This mix lays training items out that way, from
documents written for training (data/trainingdocs/; no genre, name or text of the evaluation
sets):

  * each question of a document, `variants` times: its gold section(s), 0–2 other sections of
    its document and sections of other documents, MIN_CHUNKS to MAX_CHUNKS chunks in all,
    shuffled (a retriever's order is not the document's);
  * each chunk's `contexts` entry: its document's sections before it, joined as ingestion joins
    them; distillation keeps the last `--context-tokens` tokens of it;
  * the stock pipelines' templates, in turn (TEMPLATES below), so every question is seen
    through several of them.

Document JSONL lines: {"doc", "genre", "title", "sections": [str], "questions": [{"question",
"answers", "gold": [section index], "hops", "unanswerable"}]}. Item lines are mix.py's, plus
`contexts` and `doc`.

    python -m turborag_integrations.training.docmix --out docmix.jsonl --variants 3 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.prefill.context import CONTEXT_JOIN
from ..evaluation.devset import write_jsonl
from .templates import REFUSAL

__all__ = ["Document", "DEFAULT_DOCUMENTS", "TEMPLATES", "document_mix", "load_documents"]

DEFAULT_DOCUMENTS = Path(__file__).resolve().parent.parent / "data" / "trainingdocs"
# The stock pipelines' prompts (training/templates.py) and the evaluation prompt.
TEMPLATES = ("llama_index_text_qa", "langchain_system", "langchain_rag", "eval")
MIN_CHUNKS, MAX_CHUNKS = 4, 8
MAX_OWN_EXTRA = 2  # other sections of the question's own document, at most


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]
    hops: int
    unanswerable: bool


@dataclass(frozen=True)
class Document:
    doc: str
    genre: str
    sections: tuple[str, ...]
    questions: tuple[Question, ...]

    def before(self, i: int) -> str:
        """The document's text before section i, as ingestion joins a document's chunks."""
        return CONTEXT_JOIN.join(s.strip() for s in self.sections[:i])


def _document(d: dict, where: str) -> Document:
    sections = d.get("sections")
    if not isinstance(sections, list) or len(sections) < 2 or not all(
            isinstance(s, str) and s.strip() for s in sections):
        raise ValueError(f"{where}: 'sections' must be a list of two or more non-empty strings")
    questions = []
    for j, q in enumerate(d.get("questions") or []):
        gold = tuple(q.get("gold") or ())
        unanswerable = bool(q.get("unanswerable", False))
        answers = tuple(q.get("answers") or ())
        if not isinstance(q.get("question"), str) or not q["question"].strip():
            raise ValueError(f"{where}, question {j}: 'question' must be a non-empty string")
        if any(not isinstance(g, int) or not 0 <= g < len(sections) for g in gold):
            raise ValueError(f"{where}, question {j}: 'gold' {list(gold)} must index 'sections' "
                             f"(0..{len(sections) - 1})")
        if not unanswerable and not (answers and gold):
            raise ValueError(f"{where}, question {j}: an answerable question needs 'answers' "
                             "and 'gold'; mark it \"unanswerable\": true otherwise")
        if not unanswerable and not any(answers[0] in sections[g] for g in gold):
            raise ValueError(f"{where}, question {j}: answers[0] {answers[0]!r} is in none of "
                             f"its gold sections {list(gold)}")
        questions.append(Question(q["question"].strip(), answers, gold, int(q.get("hops", 1)),
                                  unanswerable))
    return Document(str(d.get("doc", where)), str(d.get("genre", "")),
                    tuple(s.strip() for s in sections), tuple(questions))


def load_documents(paths: Sequence[str | Path] = ()) -> list[Document]:
    """The documents in the JSONL files `paths` (a folder: its *.jsonl files, sorted); the
    bundled training documents when none are given. A malformed line is an error that names
    its file and line: training on half a document set would go unnoticed."""
    files: list[Path] = []
    for p in [Path(p) for p in paths] or [DEFAULT_DOCUMENTS]:
        files.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"no document files in {', '.join(map(str, paths)) or DEFAULT_DOCUMENTS}")
    docs: list[Document] = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    docs.append(_document(json.loads(line), f"{f.name}:{n}"))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{f.name}:{n}: not JSON ({exc})") from None
    ids = [d.doc for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"document ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return docs


def _item(doc: Document, q: Question, others: Sequence[Document], template: str,
          rng: random.Random) -> dict:
    """One item: the question's gold sections, some of its document's other sections and
    sections of other documents, shuffled, each with its document's text before it."""
    n = rng.randint(MIN_CHUNKS, MAX_CHUNKS)
    rest = [i for i in range(len(doc.sections)) if i not in q.gold]
    own = list(q.gold) + rng.sample(rest, min(len(rest), rng.randint(0, MAX_OWN_EXTRA)))
    if q.unanswerable and not q.gold:  # on topic: at least one section of its document
        own = own or rng.sample(rest, 1)
    picked = [(doc, i) for i in own]
    pool = [(d, i) for d in others for i in range(len(d.sections))]
    picked += rng.sample(pool, max(0, n - len(picked)))
    rng.shuffle(picked)
    return {"question": q.question,
            "answers": [REFUSAL] if q.unanswerable else list(q.answers),
            "chunks": [d.sections[i] for d, i in picked],
            "contexts": [d.before(i) for d, i in picked],
            "gold": [] if q.unanswerable else sorted(
                k for k, (d, i) in enumerate(picked) if d is doc and i in q.gold),
            "hops": q.hops, "unanswerable": q.unanswerable, "template": template,
            "doc": doc.doc}


def document_mix(docs: Sequence[Document], variants: int = 3, seed: int = 1,
                 templates: Sequence[str] = TEMPLATES) -> list[dict]:
    """Every question of every document `variants` times, each time among other chunks and
    through the next template of `templates` (a question's variants use different ones)."""
    if variants < 1:
        raise ValueError(f"variants must be ≥ 1, not {variants}")
    if len(docs) < 2:
        raise ValueError("a document mix needs two or more documents (distractors come from the "
                         "others)")
    rng = random.Random(seed)
    items = []
    turn = 0
    for doc in docs:
        others = [d for d in docs if d is not doc]
        for q in doc.questions:
            for _ in range(variants):
                item = _item(doc, q, others, templates[turn % len(templates)], rng)
                items.append({"id": f"doc{len(items):05d}", **item})
                turn += 1
        turn += 1  # the next document's first question starts on another template
    rng.shuffle(items)
    return items


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    ap.add_argument("--documents", action="append", default=[], metavar="PATH",
                    help="a document JSONL file or a folder of them (repeatable; default: the "
                         "bundled training documents)")
    ap.add_argument("--variants", type=int, default=3,
                    help="items per question, each among other chunks and through another "
                         "template")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    try:
        docs = load_documents(a.documents)
        items = document_mix(docs, a.variants, a.seed)
    except ValueError as exc:
        ap.error(str(exc))
    write_jsonl(items, a.out)
    questions = sum(len(d.questions) for d in docs)
    print(f"{len(items)} items ({len(docs)} documents, {questions} questions, "
          f"{a.variants} variants each) -> {a.out}")


if __name__ == "__main__":
    main()
