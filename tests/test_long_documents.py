"""The long-document evaluation: the bundled set, the generator, mode parsing, η choice, and a
tiny-model run of every mode through the evaluation and the `turborag eval` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from turborag_integrations.cli import app
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.evaluation.cli import LONGDOC
from turborag_integrations.evaluation.longdoc import (MAX_TOKENS, MIN_TOKENS, LongDocument,
                                                      Question, is_long_document_set,
                                                      load_documents, make_document)
from turborag_integrations.evaluation.rapid_eval import (LongMode, choose_eta, evaluate_long,
                                                         evidence_found, long_table, make_rapid,
                                                         parse_eta_grid)
from tests.conftest import tiny_model

runner = CliRunner()


def bundled(split: str) -> list[LongDocument]:
    docs, errors = load_documents(LONGDOC / f"{split}.jsonl")
    assert errors == []
    return docs


# ---- the bundled set -------------------------------------------------------------------------

def test_bundled_splits_are_disjoint_by_document():
    dev, test = bundled("dev"), bundled("test")
    assert len(dev) == 4 and len(test) == 6
    assert {d.split for d in dev} == {"dev"} and {d.split for d in test} == {"test"}
    assert not {d.doc_id for d in dev} & {d.doc_id for d in test}
    assert not {d.document for d in dev} & {d.document for d in test}
    # different worlds: no evidence of a test question is stated in a dev document
    dev_text = " ".join(d.document for d in dev)
    assert not [s for d in test for q in d.questions for s in q.evidence if s in dev_text]


@pytest.mark.parametrize("split", ["dev", "test"])
def test_every_answer_and_evidence_is_in_its_document(split):
    for doc in bundled(split):
        assert [q.kind for q in doc.questions] == ["direct", "direct", "alias", "two-hop"]
        for q in doc.questions:
            assert q.evidence, q.id
            assert all(s in doc.document for s in q.evidence), q.id
            assert any(a in doc.document for a in q.answers), q.id
            # the answer sits in the evidence (the last evidence sentence for two steps)
            assert any(a in q.evidence[-1] for a in q.answers), q.id


def test_alias_questions_name_the_entity_only_by_its_nickname():
    for doc in bundled("dev") + bundled("test"):
        q = next(q for q in doc.questions if q.kind == "alias")
        definition, fact = q.evidence
        name = definition.split(" is known simply as ")[0].split(", ")[-1]
        alias = definition.split(" is known simply as ")[1].rstrip(".")
        assert alias in q.question and name not in q.question
        assert name in fact and alias not in fact  # the fact is stated under the real name


def test_documents_are_6k_to_8k_tokens_of_the_bundled_model(smollm2):
    tok = smollm2.tokenizer
    for doc in bundled("dev") + bundled("test"):
        n = len(tok(doc.document, add_special_tokens=False)["input_ids"])
        assert n == doc.tokens and MIN_TOKENS <= n <= MAX_TOKENS < smollm2.context_window


def test_generator_is_seeded_and_reproduces_the_bundled_document(smollm2):
    tok = smollm2.tokenizer
    count = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    first = bundled("dev")[0]
    again = make_document(first.seed, first.doc_id, "dev", count)
    assert again["document"] == first.document
    assert [q["question"] for q in again["questions"]] == [q.question for q in first.questions]


def test_loader_reports_malformed_lines(tmp_path):
    p = tmp_path / "set.jsonl"
    good = {"doc_id": "a", "document": "Text.", "questions": [{"question": "Q?", "answers": ["x"]}]}
    p.write_text("\n".join([json.dumps(good), "{oops", json.dumps({"document": "T."}),
                            json.dumps({**good, "questions": [{"question": "Q?", "answers": []}]})]))
    docs, errors = load_documents(p)
    assert [d.doc_id for d in docs] == ["a"]
    assert [n for n, _ in errors] == [2, 3, 4]
    assert "invalid JSON" in errors[0][1] and "'questions'" in errors[1][1]
    assert "'answers'" in errors[2][1]
    assert is_long_document_set(p)
    assert not is_long_document_set(LONGDOC.parent / "devset" / "test.jsonl")


# ---- modes and η -----------------------------------------------------------------------------

def test_mode_parsing():
    assert LongMode.parse("rapid:0.5") == LongMode("rapid:0.5", "rapid", 0.5)
    assert LongMode.parse("rapid") == LongMode("rapid", "rapid", None)
    assert LongMode.parse(" rag-only ").kind == "rag-only"
    assert LongMode.parse("long-context").eta is None
    for bad, message in [("rapid:abc", "η must be a number"), ("rapid:-1", "finite and ≥ 0"),
                         ("rapid:nan", "finite and ≥ 0"), ("rapid:inf", "finite and ≥ 0"),
                         ("rag-only:2", "only rapid takes"), ("rapidly", "unknown")]:
        with pytest.raises(ValueError, match=message):
            LongMode.parse(bad)


def test_eta_grid_and_choice():
    assert parse_eta_grid("4, 0,1,0.5,1") == (0.0, 0.5, 1.0, 4.0)
    with pytest.raises(ValueError, match="empty"):
        parse_eta_grid(" , ")
    with pytest.raises(ValueError, match="η must be a number"):
        parse_eta_grid("0,x")
    assert choose_eta({0.0: 50.0, 1.0: 75.0, 4.0: 75.0}) == 1.0  # ties: the smaller η
    assert choose_eta({0.0: 50.0}) == 0.0


def test_evidence_found_needs_every_sentence_whole():
    chunks = ["A is B. C is D.", "E is F."]
    assert evidence_found(["A is B.", "E is F."], chunks)
    assert not evidence_found(["C is D. E is F."], chunks)
    assert evidence_found([], chunks)


# ---- end to end on a tiny model --------------------------------------------------------------

FACTS = ["The lighthouse of Velmora is 41 metres high.", "The ferry stops every January.",
         "The Orbital Kiln fires tiles at noon.", "Velmora is nicknamed the Salt Bell.",
         "The harbour master is Orrin Selpo.", "Glacier trips leave at dawn."]


def tiny_doc(doc_id: str, shift: int = 0) -> LongDocument:
    facts = FACTS[shift:] + FACTS[:shift]
    text = "\n\n".join(f"{f} Nothing else happened that year." for f in facts)
    return LongDocument(doc_id, "test", text, [
        Question(f"{doc_id}-q0", "How high is the lighthouse?", ["41 metres"], "direct",
                 [FACTS[0]]),
        Question(f"{doc_id}-q1", "Who is harbour master of the Salt Bell?", ["Orrin Selpo"],
                 "alias", [FACTS[3], FACTS[4]])])


@pytest.fixture
def rapid(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False)
    return make_rapid(engine, gamma=3, chunk_tokens=48, threshold=-1.0, compression=3.0)


def test_every_mode_end_to_end(rapid):
    docs, dev = [tiny_doc("t0"), tiny_doc("t1", 2)], [tiny_doc("d0", 4)]
    modes = ["long-context", "rag-only", "rapid:0", "rapid:2", "rapid"]
    res = evaluate_long(rapid, docs, modes, dev_docs=dev, eta_grid=(0.0, 1.0),
                        max_new_tokens=6)
    assert list(res["modes"]) == modes
    assert len(res["answers"]) == 2 * 2 * len(modes)
    assert res["eta_chosen"] in (0.0, 1.0)
    assert set(res["dev"]["modes"]) == {"rapid:0", "rapid:1"}
    assert len(res["dev"]["answers"]) == 2 * 2
    dev_acc = {m["eta"]: m["accuracy"] for m in res["dev"]["modes"].values()}
    assert res["eta_chosen"] == choose_eta(dev_acc)
    assert res["modes"]["rapid"]["eta"] == res["eta_chosen"]
    # η = 0 is lossless: the same replies as the target alone, word for word
    assert res["modes"]["rapid:0"]["identical_long_context"] == 100
    rows = {(r["id"], r["mode"]): r for r in res["answers"]}
    for doc in docs:
        for q in doc.questions:
            row = rows[(q.id, "rapid:0")]
            assert row["answer"] == rows[(q.id, "long-context")]["answer"]
            assert row["target_prefix_hit"]  # the document was encoded once, before any mode
            assert row["drafter_chunks"] == rows[(q.id, "rag-only")]["drafter_chunks"]
            # the drafter reads fewer tokens than the target: retrieved chunks only
            assert 0 < row["drafter_prompt_tokens"] < row["target_prompt_tokens"]
    for m in res["modes"].values():
        assert 0 <= m["accuracy"] <= 100 and m["n"] == 4
    assert long_table(res).count("\n") == 2 + len(modes)


def test_dev_documents_may_not_be_evaluated(rapid):
    doc = tiny_doc("t0")
    with pytest.raises(ValueError, match="dev set that chooses η contains evaluated"):
        evaluate_long(rapid, [doc], ["rapid"], dev_docs=[doc], eta_grid=(0.0,))
    with pytest.raises(ValueError, match="give one"):
        evaluate_long(rapid, [doc], ["rapid"], dev_docs=None)
    with pytest.raises(ValueError, match="named twice"):
        evaluate_long(rapid, [doc], ["rag-only", "rag-only"])


def test_document_over_the_window_is_skipped_with_both_lengths(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False)
    rapid = make_rapid(engine, gamma=2)
    long = tiny_doc("big")
    long.document = long.document * 60  # > 2048 byte tokens
    res = evaluate_long(rapid, [long, tiny_doc("ok")], ["long-context"], max_new_tokens=4)
    assert [s["doc_id"] for s in res["skipped"]] == ["big"]
    assert "context window 2048" in res["skipped"][0]["reason"]
    assert res["modes"]["long-context"]["n"] == 2


# ---- the command -----------------------------------------------------------------------------

def test_cli_bad_modes_are_refused_before_loading_a_model():
    result = runner.invoke(app, ["eval", "--modes", "rapid:abc"])
    assert result.exit_code == 2 and "η must be a number ≥ 0" in result.output
    result = runner.invoke(app, ["eval", "--modes", "naive,rapid:0"])
    assert result.exit_code == 2 and "cannot be mixed" in result.output
    result = runner.invoke(app, ["eval", "--modes", "rapid", "--eta-grid", "0,-2"])
    assert result.exit_code == 2 and "finite and ≥ 0" in result.output


def test_cli_refuses_a_long_document_set_for_turbo_modes():
    result = runner.invoke(app, ["eval", str(LONGDOC / "test.jsonl"), "--modes", "naive"])
    assert result.exit_code == 2 and "long-document set" in result.output
