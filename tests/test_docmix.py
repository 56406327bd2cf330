"""The document mix (training/docmix.py): chunks are sections of documents, each with its own
document's text before it, mixed with other documents' sections; distillation encodes each after
exactly that text; bad document files are refused with the file and line."""

import json

import pytest

from turborag_integrations.core.prefill.context import CONTEXT_JOIN, context_token_ids
from turborag_integrations.evaluation.harness import load_items
from turborag_integrations.training.distill import build_examples, check_disjoint
from turborag_integrations.training.docmix import (MAX_CHUNKS, MIN_CHUNKS, TEMPLATES,
                                                   document_mix, load_documents)
from turborag_integrations.training.templates import REFUSAL
from tests.conftest import tiny_model


def doc(name: str, n: int = 5) -> dict:
    sections = [f"{name} section {i}: the fee for plan {i} is {10 * i + 3} crowns, and the "
                f"warden of part {i} is {name}-{i}." for i in range(n)]
    return {"doc": name, "genre": "test", "title": name, "sections": sections,
            "questions": [
                {"question": f"What is the fee for plan 2 at {name}?", "answers": ["23 crowns"],
                 "gold": [2], "hops": 1, "unanswerable": False},
                {"question": f"Who is the warden of the part whose plan costs 33 at {name}?",
                 "answers": [f"{name}-3"], "gold": [3], "hops": 2, "unanswerable": False},
                {"question": f"What is the fee for plan 9 at {name}?", "answers": [],
                 "gold": [], "hops": 1, "unanswerable": True}]}


def write_docs(path, docs) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


def test_every_chunk_carries_its_own_documents_text_before_it(tmp_path):
    docs = load_documents([write_docs(tmp_path / "d.jsonl", [doc(n) for n in "ABCD"])])
    items = document_mix(docs, variants=4, seed=3)
    assert len(items) == 4 * 3 * 4
    by_section = {s: (d, i) for d in docs for i, s in enumerate(d.sections)}
    for item in items:
        assert MIN_CHUNKS <= len(item["chunks"]) <= MAX_CHUNKS
        assert len(set(item["chunks"])) == len(item["chunks"])
        for chunk, before in zip(item["chunks"], item["contexts"]):
            d, i = by_section[chunk]
            assert before == CONTEXT_JOIN.join(d.sections[:i])
        own = [c for c in item["chunks"] if c.startswith(item["doc"] + " ")]
        assert own, "every item holds a section of its question's document"
        if item["unanswerable"]:
            assert item["answers"] == [REFUSAL] and item["gold"] == []
        else:
            assert item["gold"] and all(item["answers"][0] in item["chunks"][g]
                                        for g in item["gold"][:1])
    # a question's variants go through different templates, and every template is used
    per_question: dict[str, set] = {}
    for item in items:
        per_question.setdefault(item["question"], set()).add(item["template"])
    assert all(len(t) == len(TEMPLATES) for t in per_question.values())
    # the order within an item is not the document's: some items hold a document's later
    # section before its earlier one, as a retriever's scores may order them
    def out_of_order(item):
        seen = [by_section[c] for c in item["chunks"]]
        return any(d is e and i > j for k, (d, i) in enumerate(seen) for e, j in seen[k + 1:])
    assert any(out_of_order(item) for item in items)


def test_distillation_encodes_each_chunk_after_its_given_context(tmp_path):
    tok = tiny_model("llama").tokenizer
    docs = load_documents([write_docs(tmp_path / "d.jsonl", [doc(n) for n in "ABC"])])
    path = tmp_path / "mix.jsonl"
    items = [dict(it, template="langchain_system") for it in document_mix(docs, 1, seed=0)]
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    loaded = load_items(path)
    assert not loaded.errors and loaded.items[0].contexts == items[0]["contexts"]
    examples = build_examples(tok, loaded.items[:1], [1, 2], 0, 0, 10_000, 1, context_tokens=12)
    (ex,) = examples
    chunks, contexts = items[0]["chunks"], items[0]["contexts"]
    found = set()
    for start, length, hidden in ex.chunk_spans:  # chunks, and the separators between them
        ctx = ex.ids[start + 2:start + hidden]  # after the 2 anchor tokens
        shown = tok.decode(ex.ids[start + hidden:start + length]).strip()
        if shown in chunks:
            i = chunks.index(shown)
            assert ctx == context_token_ids(tok, contexts[i], 12, chunks[i])
            found.add(i)
        else:
            assert ctx == []
    assert found == set(range(len(chunks)))
    assert any(contexts)


def test_a_context_list_of_the_wrong_length_is_refused(tmp_path):
    path = tmp_path / "mix.jsonl"
    path.write_text(json.dumps({"id": "x", "question": "Q?", "answers": ["a"],
                                "chunks": ["a b", "c d"], "contexts": [""]}) + "\n")
    (line, reason), = load_items(path).errors
    assert line == 1 and "one per chunk" in reason


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["questions"][0].update(answers=["99 crowns"]), r"d\.jsonl:2.*99 crowns"),
    (lambda d: d["questions"][0].update(gold=[7]), r"d\.jsonl:2.*must index"),
    (lambda d: d.update(sections=["only one"]), r"d\.jsonl:2.*two or more"),
])
def test_a_bad_document_is_refused_with_its_file_and_line(tmp_path, edit, message):
    bad = doc("B")
    edit(bad)
    with pytest.raises(ValueError, match=message):
        load_documents([write_docs(tmp_path / "d.jsonl", [doc("A"), bad])])
    (tmp_path / "e.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"e\.jsonl:1: not JSON"):
        load_documents([tmp_path / "e.jsonl"])


def test_the_bundled_training_documents_share_nothing_with_the_evaluation_sets(tmp_path):
    from turborag_integrations.evaluation.cli import HANDDEV, HELDOUT

    docs = load_documents()
    assert len(docs) >= 30
    assert sum(len(d.questions) for d in docs) >= 150
    assert len({d.genre for d in docs}) == len(docs)
    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps(it) + "\n" for it in document_mix(docs, 1, seed=0)))
    report = load_items(path)
    assert not report.errors
    check_disjoint(report.items, [HANDDEV, HELDOUT])
    eval_genres = {json.loads(line)["genre"] for p in (HANDDEV, HELDOUT)
                   for line in p.read_text().splitlines()}
    assert not eval_genres & {d.genre for d in docs}
    assert document_mix(docs, 2, seed=5) == document_mix(docs, 2, seed=5)
