"""Evaluation harness, metrics and the dev-set generator."""

import json

import pytest

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.evaluation.devset import generate_devset, make_items
from turborag_integrations.evaluation.harness import (ModeSpec, evaluate, load_items,
                                                      markdown_table, write_results)
from turborag_integrations.evaluation.metrics import (contains, exact_match, is_refusal, normalize,
                                                      token_f1)
from tests.conftest import tiny_model


def test_metrics():
    assert normalize("The  Mayor, Tamsin!") == "mayor tamsin"
    assert exact_match("Tamsin Ruel.", ["tamsin ruel"]) == 1.0
    assert contains("It is Tamsin Ruel, of course", ["Tamsin Ruel"]) == 1.0
    assert contains("Tamsin Ruelle", ["Tamsin Ruel"]) == 0.0  # whole words only
    assert token_f1("Tamsin Smith", ["Tamsin Ruel"]) == pytest.approx(0.5)
    assert token_f1("", ["x"]) == 0.0


@pytest.mark.parametrize("reply", ["The context does not say.", "I don't know.",
                                   "It is not mentioned in the context.", "Unknown",
                                   "There is no information about the opening date.",
                                   "The answer cannot be determined from the context."])
def test_refusals_are_recognised(reply):
    assert is_refusal(reply)


@pytest.mark.parametrize("reply", ["38 meters", "Tamsin Ruel", "The answer is 1612.",
                                   "It opened in May, known for its bells."])
def test_answers_are_not_refusals(reply):
    assert not is_refusal(reply)


def test_unanswerable_items_load_and_malformed_ones_are_reported(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [{"id": "u", "question": "Q?", "answers": [], "chunks": ["c"], "unanswerable": True},
             {"id": "e", "question": "Q?", "answers": [], "chunks": ["c"]},
             {"id": "x", "question": "Q?", "answers": ["a"], "chunks": ["c"], "unanswerable": "yes"}]
    rep = load_items(p.write_text("\n".join(json.dumps(r) for r in lines)) and p)
    assert [i.id for i in rep.items] == ["u"] and rep.items[0].unanswerable
    assert [n for n, _ in rep.errors] == [2, 3]
    assert "unanswerable" in rep.errors[0][1] and "true or false" in rep.errors[1][1]


def test_refusal_is_correct_only_on_unanswerable_items(tmp_path, monkeypatch):
    """The headline 'correct' counts a refusal right on an unanswerable item and wrong on an
    answerable one; an answer is right only where it contains the answer."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    p = tmp_path / "d.jsonl"
    rows = [{"id": "a", "question": "Who?", "answers": ["Tamsin"], "chunks": ["Tamsin did."]},
            {"id": "u", "question": "When?", "answers": [], "chunks": ["Never."],
             "unanswerable": True}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    from turborag_integrations.core import engine as engine_mod

    class Reply:  # the tiny model's random text replaced by a fixed refusal
        def __init__(self, result):
            result.text = "The context does not say."
            self.result = result

    real = engine_mod.TurboRAGEngine.generate
    monkeypatch.setattr(engine_mod.TurboRAGEngine, "generate",
                        lambda self, *a, **k: Reply(real(self, *a, **k)).result)
    res = evaluate(engine, load_items(p).items, ["naive"], max_new_tokens=2)
    m = res["modes"]["naive"]
    assert m["correct"] == 50 and m["refused_unanswerable"] == 100
    assert m["refused_answerable"] == 100 and m["contains"] == 0 and m["n_unanswerable"] == 1


def test_anchor_modes_use_sibling_engines_on_one_model(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did.", "Orrin not."]}))
    modes = ["turbo@none", "turbo@chat", "turbo@head", "turbo@bos"]
    res = evaluate(engine, load_items(p).items, modes, max_new_tokens=3)
    assert set(res["modes"]) == set(modes)
    assert all(m["reused_fraction"] > 0 for m in res["modes"].values())
    with pytest.raises(ValueError, match="anchor"):
        ModeSpec.parse("turbo@nowhere")
    with pytest.raises(ValueError, match="turbo modes only"):
        ModeSpec.parse("naive@chat")


def test_devset_is_seeded_and_answerable_from_gold(tmp_path):
    a, b = make_items(3, 20), make_items(3, 20)
    assert a == b and make_items(4, 20) != a
    for it in a:
        gold_text = " ".join(it["chunks"][g] for g in it["gold"])
        assert it["answers"][0] in gold_text
        assert len(it["gold"]) == it["hops"] and len(it["chunks"]) == 8
    assert {it["hops"] for it in make_items(3, 60)} == {1, 2}
    files = generate_devset(tmp_path, train=5, test=3, long=1)
    train = load_items(files["train"]).items
    test = load_items(files["test"]).items
    assert len(train) == 5 and len(test) == 3
    # train and test come from different worlds: no test chunk appears in train
    assert not {c for t in test for c in t.chunks} & {c for t in train for c in t.chunks}


def test_bundled_devset_is_small_and_valid():
    from turborag_integrations.evaluation.cli import DEVSET
    for name in ("train", "test", "test_long"):
        path = DEVSET / f"{name}.jsonl"
        rep = load_items(path)
        assert rep.items and not rep.errors
    assert sum(p.stat().st_size for p in DEVSET.glob("*.jsonl")) < 2 << 20


def test_bundled_heldout_set_is_valid():
    from turborag_integrations.evaluation.cli import HELDOUT
    rep = load_items(HELDOUT)
    assert not rep.errors and len(rep.items) >= 60
    una = [i for i in rep.items if i.unanswerable]
    assert len(una) >= 10 and all(not i.answers for i in una)
    for it in rep.items:
        if not it.unanswerable:  # the canonical answer is in a gold chunk, verbatim
            assert any(it.answers[0] in it.chunks[g] for g in it.gold), it.id


def test_malformed_lines_are_reported_with_line_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    good = {"id": "a", "question": "Q?", "answers": ["x"], "chunks": ["c"], "extra": 1}
    p.write_text("\n".join([json.dumps(good), "{oops", json.dumps({"question": "Q"}), "",
                            json.dumps([1, 2]), json.dumps({**good, "id": "b"})]) + "\n")
    rep = load_items(p)
    assert [i.id for i in rep.items] == ["a", "b"]
    assert [n for n, _ in rep.errors] == [2, 3, 5]


def test_mode_spec():
    s = ModeSpec.parse("ft:turbo-composite+boundary:8")
    assert (s.finetuned, s.mode, s.positions, s.recovery) == (True, "turbo", "composite", "boundary:8")
    assert ModeSpec.parse("naive").mode == "naive"
    for bad in ("fast", "naive+boundary:4", "turbo+nope"):
        with pytest.raises(ValueError):
            ModeSpec.parse(bad)


def test_evaluate_tiny_model(tmp_path):
    loaded = tiny_model("llama")
    engine = TurboRAGEngine(loaded, store=tmp_path / "kv")
    p = tmp_path / "d.jsonl"
    rows = [{"id": "a", "question": "Who?", "answers": ["Tamsin"], "chunks": ["Tamsin did.", "Orrin not."]},
            {"id": "b", "question": "When?", "answers": ["1612"], "chunks": ["In 1612.", "Never."]},
            {"id": "long", "question": "Q?", "answers": ["x"], "chunks": ["y" * 3000]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    items = load_items(p).items
    modes = ["naive", "turbo", "turbo-composite", "turbo+boundary:4", "turbo+blend:0.5"]
    res = evaluate(engine, items, modes, max_new_tokens=4)
    assert [s["id"] for s in res["skipped"]] == ["long"]
    assert "context window" in res["skipped"][0]["reason"]
    assert set(res["modes"]) == set(modes)
    for name, m in res["modes"].items():
        assert m["n"] == 2 and {"contains", "em", "f1", "ttft_s", "agreement",
                                "reused_fraction"} <= set(m)
    # naive is the reference: no agreement with itself, shown as "—"
    assert res["modes"]["naive"]["agreement"] is None and res["modes"]["naive"]["reused_fraction"] == 0
    assert all(res["modes"][m]["agreement"] is not None for m in modes[1:])
    assert "| naive | " in markdown_table(res)
    naive_line = next(l for l in markdown_table(res).splitlines() if l.startswith("| naive |"))
    assert naive_line.split("|")[7].strip() == "—"
    assert res["modes"]["turbo"]["reused_fraction"] > res["modes"]["turbo+boundary:4"]["reused_fraction"] > 0
    assert len(res["answers"]) == 2 * len(modes)
    notes = write_results(res, tmp_path / "out", png=True)
    assert (tmp_path / "out" / "results.json").exists() and (tmp_path / "out" / "answers.jsonl").exists()
    assert "| turbo+boundary:4 |" in (tmp_path / "out" / "table.md").read_text()
    assert (tmp_path / "out" / "plot.png").exists() or "matplotlib" in notes[0]
    assert markdown_table(res).count("\n") == 2 + len(modes)


def test_finetuned_modes_agree_with_their_own_naive_reply(tmp_path):
    """ft: modes are compared with ft:naive, not with the base model's reply."""
    base = TurboRAGEngine(tiny_model("llama", seed=0), store=tmp_path / "kv")
    other = TurboRAGEngine(tiny_model("llama", seed=9), store=tmp_path / "kv-ft")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did.", "Orrin not."]}))
    res = evaluate(base, load_items(p).items, ["ft:turbo+boundary:100000", "naive", "ft:naive"],
                   max_new_tokens=6, ft_engine=other)
    assert res["modes"]["ft:naive"]["agreement"] is None  # the references
    assert res["modes"]["naive"]["agreement"] is None
    # recomputing every chunk token is a full prefill: the same reply as ft:naive
    assert res["modes"]["ft:turbo+boundary:100000"]["agreement"] == 100
    assert [r["mode"] for r in res["answers"] if "agrees_with_naive" in r] == [
        "ft:turbo+boundary:100000"]


def test_an_item_skipped_in_one_mode_is_skipped_in_every_mode(tmp_path):
    """Chunks ending in a space: inside the whole prompt " \n" is one token (the tokenizer merges
    it); stitched, each chunk ends with " " and the text after it starts with "\n", one token more
    per chunk. With the window one token past the whole prompt, naive answers the item and the
    stitched prompt does not fit: the item must then count in neither mode."""
    from turborag_integrations.core.prefill.segment import split_prompt
    from turborag_integrations.evaluation.prompt import build_prompt
    from tests.conftest import byte_tokenizer

    merges = (("Ġ", "Ċ"),)
    rows = [{"id": "fits", "question": "Who?", "answers": ["Tamsin"],
             "chunks": ["Tamsin did.", "Orrin not."]},
            {"id": "edge", "question": "Who did it then?", "answers": ["Tamsin"],
             "chunks": ["Tamsin did ", "Orrin not "]}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    items = load_items(p).items
    tok = byte_tokenizer(merges)
    n = {}
    for it in items:
        prompt, texts = build_prompt(tok, it.question, it.chunks)
        n[it.id] = len(tok(prompt, add_special_tokens=False)["input_ids"])
        stitched = sum(len(tok(t, add_special_tokens=False)["input_ids"])
                       for t, _ in split_prompt(prompt, texts))
        assert stitched - n[it.id] == (2 if it.id == "edge" else 0)
    assert n["fits"] < n["edge"]
    engine = TurboRAGEngine(tiny_model("llama", merges=merges, context_window=n["edge"] + 1),
                            store=tmp_path / "kv")
    res = evaluate(engine, items, ["naive", "turbo"], max_new_tokens=1)
    assert [s["id"] for s in res["skipped"]] == ["edge"]
    assert res["modes"]["naive"]["n"] == res["modes"]["turbo"]["n"] == 1
    assert sorted((r["mode"], r["id"]) for r in res["answers"]) == [("naive", "fits"),
                                                                     ("turbo", "fits")]
    reason = res["skipped"][0]["reason"]
    assert reason.startswith("turbo: ") and f"context window of {n['edge'] + 1}" in reason


def test_a_mode_named_twice_is_refused(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    with pytest.raises(ValueError, match="named twice"):
        evaluate(engine, [], ["naive", "turbo", "naive"])


def test_evaluation_never_imports_training():
    """Training builds on evaluation (items, prompt, dev set); the reverse would be a cycle."""
    import ast
    from pathlib import Path

    import turborag_integrations.evaluation as evaluation

    for path in Path(evaluation.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            # `from ..training.x import y`, `from .. import training`, `import ...training`
            names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            assert not any("training" in n.split(".") for n in names), (path.name, names)
