"""Evaluation harness, metrics and the dev-set generator."""

import json

import pytest

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.context import document_contexts
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


def test_encoder_modes_compare_encoders_against_one_full_prefill(tmp_path):
    """turbo#FILE and turbo#none run on siblings of the one engine: each chunk encoding gets
    blobs of its own (its fingerprint), and only the blobs differ, so the replies may."""
    from tests.core.prefill.test_encoding import encoding_for

    loaded = tiny_model("llama")
    path = encoding_for(loaded, soft=3, rank=4).save(tmp_path / "enc.safetensors")
    engine = TurboRAGEngine(loaded, store=tmp_path / "kv", encoder=None)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did it in May.", "Orrin did not."]}))
    modes = ["naive", "turbo", "turbo#none", f"turbo#{path}"]
    res = evaluate(engine, load_items(p).items, modes, max_new_tokens=4)
    by = {r["mode"]: r for r in res["answers"]}
    assert by["turbo"]["reply_kl"] == pytest.approx(by["turbo#none"]["reply_kl"], abs=1e-9)
    assert by[f"turbo#{path}"]["reply_kl"] != pytest.approx(by["turbo"]["reply_kl"], abs=1e-6)
    assert res["modes"][f"turbo#{path}"]["reused_fraction"] > 0
    with pytest.raises(ValueError, match="turbo modes only"):
        ModeSpec.parse("naive#none")
    with pytest.raises(ValueError, match="neither"):
        ModeSpec.parse("turbo#/no/such/file")


def test_context_modes_encode_each_chunk_after_its_items_previous_chunk(tmp_path):
    """turbo~N runs on a sibling whose blobs are encoded after the item's chunks before (its
    fingerprint differs); turbo~0 is the training-free engine's own blobs."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", encoder=None,
                            context_tokens=0)
    chunks = ["Tamsin did it in May.", "Orrin did not.", "Nobody else was there."]
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": chunks}))
    modes = ["naive", "turbo", "turbo~0", "turbo~8"]
    res = evaluate(engine, load_items(p).items, modes, max_new_tokens=4)
    by = {r["mode"]: r for r in res["answers"]}
    assert by["turbo~0"]["reply_kl"] == pytest.approx(by["turbo"]["reply_kl"], abs=1e-9)
    assert by["turbo~8"]["reply_kl"] != pytest.approx(by["turbo"]["reply_kl"], abs=1e-6)
    sibling = TurboRAGEngine(engine.loaded, store=engine.store, encoder=None, context_tokens=8)
    enc = sibling.library.encoder
    for before, text in zip(document_contexts(chunks, 8), chunks):
        blob = sibling.library.blob_for(text)  # stored by the evaluation, found by its fingerprint
        assert blob is not None
        assert blob.base_position == enc.base_position + len(enc.context_ids(before))
    assert sibling.library.blob_for(chunks[2]).base_position == enc.base_position + 8
    assert ModeSpec.parse("turbo+boundary:8@chat~64#none").context == 64
    assert ModeSpec.parse("turbo").context is None
    for bad in ("turbo~", "turbo~x", "naive~8", "turbo-oracle~8"):
        with pytest.raises(ValueError):
            ModeSpec.parse(bad)


def test_an_items_own_contexts_are_what_its_chunks_are_encoded_after(tmp_path):
    """Chunks in another order than their document's: each is encoded after the text the item
    gives for it, not after the chunks before it in the prompt."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", encoder=None,
                            context_tokens=0)
    chunks = ["Nobody else was there.", "Tamsin did it in May.", "Orrin did not."]
    contexts = ["Tamsin did it in May.\n\nOrrin did not.", "", "Tamsin did it in May."]
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": chunks, "contexts": contexts}))
    evaluate(engine, load_items(p).items, ["naive", "turbo~8"], max_new_tokens=4)
    sibling = TurboRAGEngine(engine.loaded, store=engine.store, encoder=None, context_tokens=8)
    enc = sibling.library.encoder
    for before, text in zip(contexts, chunks):
        blob = sibling.library.blob_for(text)
        assert blob is not None
        assert blob.base_position == enc.base_position + len(enc.context_ids(before or None))
    assert sibling.library.blob_for(chunks[1]).base_position == enc.base_position  # first: none
    assert sibling.library.blob_for(chunks[0]).base_position == enc.base_position + 8  # not the prompt's


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
    s = ModeSpec.parse("turbo+boundary:8")
    assert (s.mode, s.recovery) == ("turbo", "boundary:8")
    assert ModeSpec.parse("naive").mode == "naive"
    for bad in ("fast", "naive+boundary:4", "turbo+nope", "ft:turbo", "turbo-composite"):
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
    modes = ["naive", "turbo", "turbo+none", "turbo+boundary:4", "turbo+blend:0.5"]
    res = evaluate(engine, items, modes, max_new_tokens=4)
    assert [s["id"] for s in res["skipped"]] == ["long"]
    assert "context window" in res["skipped"][0]["reason"]
    assert set(res["modes"]) == set(modes)
    for name, m in res["modes"].items():
        assert m["n"] == 2 and {"contains", "em", "f1", "ttft_s", "agreement",
                                "correct_agreement", "reply_kl", "reply_top1",
                                "reused_fraction"} <= set(m)
    # naive is the reference: no agreement with itself, shown as "—"
    naive = res["modes"]["naive"]
    assert naive["agreement"] is naive["correct_agreement"] is naive["reply_kl"] is None
    assert naive["reply_top1"] is None and naive["reused_fraction"] == 0
    for name in modes[1:]:
        m = res["modes"][name]
        assert None not in (m["agreement"], m["correct_agreement"], m["reply_kl"], m["reply_top1"])
        assert m["reply_kl"] >= 0 and 0 <= m["reply_top1"] <= 100
    table = markdown_table(res)
    header = [c.strip() for c in table.splitlines()[0].split("|")[1:-1]]
    assert header[:6] == ["mode", "correct %", "same reply as full %", "correctness agrees %",
                          "reply KL", "reply top-1 %"]
    assert "agreement w/ naive %" not in header
    assert "| naive | " in table
    naive_line = next(l for l in table.splitlines() if l.startswith("| naive |"))
    assert [c.strip() for c in naive_line.split("|")[3:7]] == ["—"] * 4
    turbo_line = next(l for l in table.splitlines() if l.startswith("| turbo |"))
    assert turbo_line.split("|")[6].strip() == f"{res['modes']['turbo']['reply_top1']:.1f}"
    assert res["modes"]["turbo"]["reused_fraction"] > res["modes"]["turbo+boundary:4"]["reused_fraction"] > 0
    assert len(res["answers"]) == 2 * len(modes)
    notes = write_results(res, tmp_path / "out", png=True)
    assert (tmp_path / "out" / "results.json").exists() and (tmp_path / "out" / "answers.jsonl").exists()
    assert "| turbo+boundary:4 |" in (tmp_path / "out" / "table.md").read_text()
    assert (tmp_path / "out" / "plot.png").exists() or "matplotlib" in notes[0]
    assert markdown_table(res).count("\n") == 2 + len(modes)


def test_an_item_skipped_in_one_mode_is_skipped_in_every_mode(tmp_path, monkeypatch):
    """Chunks ending in a space: inside the whole prompt " \n" is one token (the tokenizer merges
    it). A tokenizer that cannot say where its tokens start (simulated here) makes the engine
    tokenize the pieces alone: each chunk then ends with " " and the text after it starts with
    "\n", one token more per chunk. With the window one token past the whole prompt, naive
    answers the item and the stitched prompt does not fit: the item must then count in neither
    mode. (With offsets the stitched prompt is the whole prompt's tokens, and fits as it does.)"""
    import turborag_integrations.core.assembly as engine_module
    from turborag_integrations.core.prefill.segment import split_prompt

    monkeypatch.setattr(engine_module, "tokenize_with_starts", lambda tokenizer, prompt: None)
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


def test_token_agreement_of_identical_and_different_logits():
    import math

    import torch

    from turborag_integrations.evaluation.agreement import token_agreement

    torch.manual_seed(0)
    ref = torch.randn(5, 11) * 3
    assert token_agreement(ref, ref.clone()) == (0.0, 100.0)
    assert token_agreement(ref, ref + 7.0) == pytest.approx((0.0, 100.0), abs=1e-12)  # a shift
    # two positions over a vocabulary of 2, by hand: p = (0.5, 0.5) and q = (0.9, 0.1) at the
    # first (argmax 0 for both: torch takes the first of a tie), p = (0.9, 0.1) and q = (0.1,
    # 0.9) at the second (argmax 0 against 1)
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
    q = torch.tensor([[0.9, 0.1], [0.1, 0.9]]).log()
    kl0 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl1 = 0.9 * math.log(0.9 / 0.1) + 0.1 * math.log(0.1 / 0.9)
    kl, top1 = token_agreement(p, q)
    assert kl == pytest.approx((kl0 + kl1) / 2) and top1 == 50.0
    assert token_agreement(q, p)[0] != pytest.approx(kl)  # KL(naive ‖ mode), not symmetric
    # a token the reference rules out costs nothing, whatever the mode gives it
    kl, _ = token_agreement(torch.tensor([[0.0, float("-inf")]]), torch.tensor([[0.0, 0.0]]))
    assert kl == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        token_agreement(torch.zeros(0, 3), torch.zeros(0, 3))


def test_teacher_forced_naive_reply_reproduces_the_greedy_reply(tmp_path):
    """The reference logits are those greedy decoding followed: their argmax at each reply
    position is the reply's token; the same path again (turbo without cached chunks is a plain
    prefill) agrees exactly, a stitched one does not."""
    import torch

    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.evaluation.agreement import reply_logits, token_agreement
    from turborag_integrations.evaluation.prompt import build_prompt

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    prompt, texts = build_prompt(engine.tokenizer, "Who?", ["Tamsin did.", "Orrin not."])
    res = engine.generate(prompt, mode="naive", config=GenerationConfig(max_new_tokens=6))
    ids = res.token_ids
    assert len(ids) > 1
    ref = reply_logits(engine, prompt, ids, mode="naive")
    assert ref.shape[0] == len(ids) and ref.dtype == torch.float32
    assert ref.argmax(-1).tolist() == ids
    # the same logits as one causal forward over prompt + reply, without any cache
    pre = engine.prefill(engine.assembly.segments(prompt)[0])
    engine.cache_pool.release(pre.cache)
    seq = list(pre.plan.token_ids) + ids
    with torch.inference_mode():
        whole = engine.model(input_ids=torch.tensor([seq])).logits[0].float()
    n = len(pre.plan.token_ids)
    torch.testing.assert_close(ref, whole[n - 1:n - 1 + len(ids)], atol=1e-4, rtol=1e-4)
    same = reply_logits(engine, prompt, ids, mode="turbo")  # no chunks: one plain segment
    assert token_agreement(ref, same) == (0.0, 100.0)
    engine.encode_chunks(texts)
    stitched = reply_logits(engine, prompt, ids, chunks=texts, mode="turbo")
    assert stitched.shape == ref.shape
    assert token_agreement(ref, stitched)[0] > 1e-6


def test_token_agreement_in_evaluate(tmp_path):
    """Recomputing every chunk token is a full prefill: KL 0 and top-1 100 against naive, up to
    rounding; plain stitching differs. --no-token-agreement leaves the fields out."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did.", "Orrin not."]}))
    items = load_items(p).items
    res = evaluate(engine, items, ["turbo+boundary:100000", "turbo", "naive"], max_new_tokens=6)
    full, turbo = res["modes"]["turbo+boundary:100000"], res["modes"]["turbo"]
    assert full["reply_kl"] == pytest.approx(0.0, abs=1e-6) and full["reply_top1"] == 100
    assert turbo["reply_kl"] > 1e-6
    rows = {r["mode"]: r for r in res["answers"]}
    assert rows["turbo"]["reply_kl"] == turbo["reply_kl"]
    assert "reply_kl" not in rows["naive"] and "correct_agrees" not in rows["naive"]
    off = evaluate(engine, items, ["naive", "turbo"], max_new_tokens=6, token_agreement=False)
    assert off["modes"]["turbo"]["reply_kl"] is off["modes"]["turbo"]["reply_top1"] is None
    assert off["modes"]["turbo"]["agreement"] is not None
    assert all("reply_kl" not in r for r in off["answers"])
    # without a naive mode there is no reference: nothing to compare with
    alone = evaluate(engine, items, ["turbo"], max_new_tokens=2)
    assert alone["modes"]["turbo"]["reply_kl"] is alone["modes"]["turbo"]["agreement"] is None


def test_correct_agreement_and_same_reply(tmp_path, monkeypatch):
    """Fixed replies per mode and question: agreement compares the replies, correct_agreement
    whether both are right or both wrong; an empty naive reply has no token agreement."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    p = tmp_path / "d.jsonl"
    rows = [{"id": "a", "question": "Who?", "answers": ["Tamsin"], "chunks": ["Tamsin did."]},
            {"id": "b", "question": "When?", "answers": ["1612"], "chunks": ["In 1612."]},
            {"id": "c", "question": "Why?", "answers": ["rain"], "chunks": ["For rain."]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    replies = {  # (mode, recovery) -> reply per question
        ("naive", None): {"Who?": "Tamsin", "When?": "no idea", "Why?": ""},
        ("turbo", None): {"Who?": "Tamsin.", "When?": "in 1600", "Why?": "rain"},
        ("turbo", "none"): {"Who?": "Orrin", "When?": "no idea", "Why?": ""},
    }
    from turborag_integrations.core import engine as engine_mod

    real = engine_mod.TurboRAGEngine.generate

    def fixed(self, prompt, **k):
        result = real(self, prompt, **k)
        table = replies[k["mode"], k.get("recovery") if k["mode"] == "turbo" else None]
        result.text = next((v for q, v in table.items() if q in prompt), result.text)  # warmup
        if result.text == "":
            result.token_ids = []  # an empty reply, as after an end-of-sequence first token
        return result

    monkeypatch.setattr(engine_mod.TurboRAGEngine, "generate", fixed)
    res = evaluate(engine, load_items(p).items, ["naive", "turbo", "turbo+none"],
                   max_new_tokens=3)
    m = res["modes"]
    # turbo: same reply on a only; correct as naive on a (both right), b (both wrong), not c
    assert m["turbo"]["agreement"] == pytest.approx(100 / 3)
    assert m["turbo"]["correct_agreement"] == pytest.approx(200 / 3)
    # turbo+none: same reply on b and c; correctness agrees on b and c (a: wrong vs right)
    assert m["turbo+none"]["agreement"] == pytest.approx(200 / 3)
    assert m["turbo+none"]["correct_agreement"] == pytest.approx(200 / 3)
    assert m["naive"]["correct_agreement"] is None
    by = {(r["mode"], r["id"]): r for r in res["answers"]}
    assert [by["turbo", i]["correct_agrees"] for i in "abc"] == [1.0, 1.0, 0.0]
    assert [by["turbo+none", i]["correct_agrees"] for i in "abc"] == [0.0, 1.0, 1.0]
    # c's naive reply is empty: no positions to compare, and the means leave it out
    assert by["turbo", "c"]["reply_kl"] is None and by["turbo", "c"]["reply_top1"] is None
    assert by["turbo", "a"]["reply_kl"] is not None
    assert m["turbo"]["reply_kl"] == pytest.approx(
        (by["turbo", "a"]["reply_kl"] + by["turbo", "b"]["reply_kl"]) / 2)


def test_eval_command_options(tmp_path, monkeypatch):
    """--encoder reaches the engine ('none' as None), and --no-token-agreement reaches
    evaluate."""
    from typer.testing import CliRunner

    from turborag_integrations.cli import app
    from turborag_integrations.core import engine as engine_mod

    real = engine_mod.TurboRAGEngine
    made = []

    def engine(model=None, **kwargs):
        made.append(dict(kwargs))
        kwargs.pop("encoder", None)  # recorded; the tiny model has no encoder of its own
        return real(tiny_model("llama"), **kwargs)

    monkeypatch.setattr(engine_mod, "TurboRAGEngine", engine)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did."]}))
    runner = CliRunner()
    for args, encoder, agreement in (([], "default", True),
                                     (["--encoder", "none", "--no-token-agreement"], None, False),
                                     (["--encoder", "x/enc.safetensors"], "x/enc.safetensors",
                                      True)):
        out = tmp_path / f"out{len(made)}"
        result = runner.invoke(app, ["eval", str(p), "--modes", "naive,turbo", "--out", str(out),
                                     "--max-new-tokens", "2", *args])
        assert result.exit_code == 0, result.output
        assert made[-1]["encoder"] == encoder
        summary = json.loads((out / "results.json").read_text())
        assert summary["encoder"] == encoder
        assert (summary["modes"]["turbo"]["reply_kl"] is not None) == agreement
        assert "same reply as full %" in (out / "table.md").read_text()


def test_system_instruction_reaches_every_prompt(tmp_path, monkeypatch):
    """evaluate(system=...) builds every mode's prompt with that instruction (the default one
    nowhere), and the CLI's --system reaches evaluate and results.json."""
    from typer.testing import CliRunner

    from turborag_integrations.cli import app
    from turborag_integrations.core import engine as engine_mod
    from turborag_integrations.evaluation.prompt import SYSTEM

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv")
    prompts = []
    real_generate = engine.generate

    def generate(prompt, **kwargs):
        prompts.append(prompt)
        return real_generate(prompt, **kwargs)
    monkeypatch.setattr(engine, "generate", generate)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did.", "Orrin sold kites."]}))
    refuse = "If the context does not say, reply: not in the context."
    res = evaluate(engine, load_items(p).items, ["naive", "naive-rotated", "turbo"],
                   max_new_tokens=2, system=refuse)
    asked = [q for q in prompts if "Question: Who?" in q]  # not the engine's warm-up
    assert len(asked) == 3 and set(res["modes"]) == {"naive", "naive-rotated", "turbo"}
    assert all(refuse in q and SYSTEM not in q for q in asked)
    with pytest.raises(ValueError, match="system instruction is empty"):
        evaluate(engine, load_items(p).items, ["naive"], system="  ")

    real = engine_mod.TurboRAGEngine
    monkeypatch.setattr(engine_mod, "TurboRAGEngine", lambda model=None, **kw: real(
        tiny_model("llama"), **{**kw, "encoder": None}))
    for args, expected in (([], SYSTEM), (["--system", refuse], refuse)):
        out = tmp_path / f"out{len(args)}"
        result = CliRunner().invoke(app, ["eval", str(p), "--modes", "naive,turbo", "--out",
                                          str(out), "--max-new-tokens", "2", *args])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "results.json").read_text())["system"] == expected
        rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
        assert len(rows) == 2


def test_reference_modes_bound_the_agreement(tmp_path):
    """turbo-oracle stitches the full prefill's own KV: it must agree with the full prefill on
    every item and every token (the stitched prompt is the full prompt's tokens); naive-rotated
    is the same model over the same chunks in another order, compared by its reply only."""
    engine = TurboRAGEngine(tiny_model("llama", merges=(("Ċ", "Ċ"),)), store=tmp_path / "kv")
    p = tmp_path / "d.jsonl"
    rows = [{"id": str(i), "question": q, "answers": ["x"],
             "chunks": [f"Tamsin keeps {i} owls.", "Orrin sells kites.", "The bell rang."]}
            for i, q in enumerate(["Who keeps owls?", "Who sells kites?", "What rang?"])]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    modes = ["naive", "naive-rotated", "turbo-oracle", "turbo"]
    res = evaluate(engine, load_items(p).items, modes, max_new_tokens=6)
    oracle, rotated = res["modes"]["turbo-oracle"], res["modes"]["naive-rotated"]
    assert oracle["agreement"] == 100 and oracle["reply_top1"] == 100
    assert oracle["reply_kl"] < 1e-6 and oracle["reused_fraction"] > 0.5
    assert rotated["agreement"] is not None and rotated["reply_kl"] is None
    assert res["modes"]["naive"]["agreement"] is None
    for bad in ("naive-rotated+boundary:4", "turbo-oracle~8", "turbo-oracle#none"):
        with pytest.raises(ValueError, match="reference"):
            ModeSpec.parse(bad)


def test_chunk_encoding_reports_progress_per_encoding(tmp_path):
    """A larger model spends minutes encoding before the first mode: each encoding says so,
    once for the modes that share its blobs."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", encoder=None)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                             "chunks": ["Tamsin did it in May.", "Orrin did not."]}))
    seen = []
    evaluate(engine, load_items(p).items, ["naive", "turbo", "turbo+boundary:4", "turbo@bos"],
             max_new_tokens=2, progress=lambda *call: seen.append(call), token_agreement=False)
    encoding = [c for c in seen if c[0].startswith("encoding chunks")]
    assert [c[0] for c in encoding if c[1] == c[2]] == [
        "encoding chunks for turbo, turbo+boundary:4", "encoding chunks for turbo@bos"]
    assert {c[2] for c in encoding} == {2}
