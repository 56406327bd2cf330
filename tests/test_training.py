"""Fine-tuning: the collator builds exactly the inference layout (invariant 2)."""

import json

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.stitch import plan_prompt, prefill
from turborag_integrations.evaluation.prompt import build_prompt
from turborag_integrations.training.collator import (IGNORE, TurboRAGCollator, add_doc_tokens,
                                                     answer_loss, build_example, forward_logits)
from turborag_integrations.training.finetune import FinetuneConfig, finetune
from tests.conftest import tiny_model

CHUNKS = ["The town of Velkaro was founded in 1612.", "Orbis Works makes kite sails.",
          "Tamsin Ruel keeps an owl named Zanye."]
Q, A = "Who keeps an owl?", "Tamsin Ruel"


@pytest.mark.parametrize("anchor", ["chat", "none"])
@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_training_forward_equals_stitched_inference(model_type, positions, anchor, tmp_path):
    loaded = tiny_model(model_type)
    engine = TurboRAGEngine(loaded, store=tmp_path / "kv", anchor=anchor)
    prompt, texts = build_prompt(loaded.tokenizer, Q, CHUNKS)
    engine.encode_chunks(texts)
    segments, hits, _ = engine.segments(prompt, texts)
    assert hits == len(CHUNKS)
    plan = plan_prompt(segments, loaded.tokenizer, positions=positions,
                       fingerprint=engine.fingerprint)
    stitched = prefill(loaded.model, plan, engine.rotator, all_logits=True)

    anchor_ids = engine.encoder.anchor_ids
    assert bool(anchor_ids) == (anchor != "none")
    ex = build_example(loaded.tokenizer, Q, CHUNKS, A, positions=positions, anchor_ids=anchor_ids)
    shift = len(anchor_ids)  # the layout shifts positions so no anchor copy is negative
    assert [ex.input_ids[i] for i in ex.prompt_index] == plan.token_ids
    assert [ex.position_ids[i] - shift for i in ex.prompt_index] == plan.positions
    # an anchor copy before each chunk and each "\n\n" stitched between two of them
    spans = len(CHUNKS) + len(CHUNKS) - 1
    assert len(ex.input_ids[:ex.prompt_len]) == len(plan.token_ids) + spans * shift
    assert all(l == IGNORE for l in ex.labels[:ex.prompt_len])
    answer = loaded.tokenizer.decode([t for t in ex.labels if t != IGNORE])
    assert answer.startswith(A)
    batch = TurboRAGCollator(loaded.tokenizer.pad_token_id)([ex])
    with torch.no_grad():
        logits = forward_logits(loaded.model, batch)[0]
    rows = [ex.prompt_index[i] for i in plan.plain_index]
    torch.testing.assert_close(logits[rows], stitched.logits, atol=1e-4, rtol=0)
    # Chunk tokens see only their own chunk; nothing after a chunk sees its anchor copy.
    mask = ex.mask()
    for start, n, hidden in ex.chunk_spans:
        assert not mask[start:start + n, :start].any()
        assert not mask[start + n:, start:start + hidden].any()


def test_padding_does_not_change_an_example(tiny_llama):
    tok = tiny_llama.tokenizer
    short = build_example(tok, Q, CHUNKS[:1], A)
    long = build_example(tok, Q, CHUNKS, A)
    collate = TurboRAGCollator(tok.pad_token_id)
    with torch.no_grad():
        alone = forward_logits(tiny_llama.model, collate([short]))[0]
        padded = forward_logits(tiny_llama.model, collate([short, long]))[0, :len(short.input_ids)]
        assert torch.isfinite(answer_loss(tiny_llama.model, collate([short, long])))
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=0)


def test_doc_tokens_are_single_tokens_inside_chunks(tiny_llama):
    tok = tiny_llama.tokenizer
    ids = add_doc_tokens(tok, tiny_llama.model)
    assert tiny_llama.model.get_input_embeddings().weight.shape[0] >= len(tok)
    ex = build_example(tok, Q, CHUNKS, A, doc_tokens=True)
    # [0] is the cached prefix, then chunk, separator, chunk, …
    assert len(ex.chunk_spans) == 1 + 2 * len(CHUNKS) - 1
    for start, n, _ in ex.chunk_spans[1::2]:
        assert ex.input_ids[start] == ids[0] and ex.input_ids[start + n - 1] == ids[1]


@pytest.mark.parametrize("lora", [False, True])
def test_finetune_saves_a_folder_the_engine_loads(tmp_path, lora):
    if lora:
        pytest.importorskip("peft")
    data = tmp_path / "train.jsonl"
    rows = [{"id": str(i), "question": Q, "answers": [A], "chunks": CHUNKS, "gold": [2]}
            for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    out = tmp_path / "ft"
    summary = finetune(FinetuneConfig(data=str(data), out=str(out), steps=3, batch_size=2,
                                      lr=1e-3, lora=lora, doc_tokens=True, max_chunks=2),
                       loaded=tiny_model("llama"), log=lambda m: None)
    assert summary["steps"] == 3 and (out / "turborag_finetune.json").exists()
    engine = TurboRAGEngine(str(out), store=tmp_path / "kv", progress=False)
    prompt, texts = build_prompt(engine.tokenizer, Q, CHUNKS, doc_tokens=True)
    engine.encode_chunks(texts)
    from turborag_integrations.core.settings import GenerationConfig
    res = engine.generate(prompt, chunks=texts, config=GenerationConfig(max_new_tokens=2))
    assert res.stats.cache_hits == len(CHUNKS)


def test_finetune_command_is_registered_from_training():
    from typer.testing import CliRunner

    from turborag_integrations.cli import app
    from turborag_integrations.training.cli import finetune_command

    assert any(c.callback is finetune_command for c in app.registered_commands)
    result = CliRunner().invoke(app, ["finetune", "--help"])
    assert result.exit_code == 0 and "--lora-rank" in result.output
    result = CliRunner().invoke(app, ["finetune", "out", "--positions", "diagonal"])
    assert result.exit_code == 2 and "positions must be reordered or composite" in result.output


def test_retemplate_moves_one_templates_items_and_leaves_the_rest_of_the_mix(tmp_path):
    from turborag_integrations.training.mix import generate_mix, main, retemplate

    items = generate_mix(60, seed=3)
    before = [dict(it) for it in items]
    refine = sum(it["template"] == "llama_index_refine" for it in items)
    assert refine > 0
    assert retemplate(items, "llama_index_refine", "llama_index_text_qa") == refine
    for old, new in zip(before, items):
        expected = "llama_index_text_qa" if old["template"] == "llama_index_refine" else old["template"]
        assert new == {**old, "template": expected}
    with pytest.raises(ValueError, match="unknown template 'nope'"):
        retemplate(items, "nope", "eval")
    out = tmp_path / "mix.jsonl"
    main(["--out", str(out), "--n", "60", "--seed", "3",
          "--retemplate", "llama_index_refine=llama_index_text_qa"])
    assert [json.loads(line) for line in out.read_text().splitlines()] == items
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--retemplate", "refine"])
