"""Self-distilled chunk encoders (training/distill.py): the objective falls, the file it saves is
the one the engine loads, the model is never changed, and training data that overlaps an
evaluation set is refused."""

import json
import random

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.evaluation.harness import load_items
from turborag_integrations.core.prefill.context import context_token_ids
from turborag_integrations.core.prefill.encoding import LearnedEncoding
from turborag_integrations.training.distill import (DistillConfig, check_disjoint, distill,
                                                    kl_loss, training_contexts)
from tests.conftest import tiny_model

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles.",
          "The river Xan flows north to the sea.", "Carol paints blue doors in Lyon."]


def write_set(path, n=6, prefix="t"):
    rows = [{"id": f"{prefix}{i}", "question": f"Who keeps bicycles, case {i}?",
             "answers": ["Bob"], "chunks": CHUNKS[i % 2:] + CHUNKS[:i % 2], "gold": [1],
             "template": ["eval", "llama_index_text_qa", "langchain_rag"][i % 3]}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    a = torch.randn(3, 11)
    assert float(kl_loss(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_loss(a, a + torch.randn(3, 11))) > 1e-3


@pytest.mark.parametrize("soft,rank,context", [(4, 0, 0), (2, 4, 0), (2, 4, 24)])
def test_distill_lowers_the_divergence_and_saves_what_the_engine_loads(tmp_path, soft, rank,
                                                                       context):
    loaded = tiny_model("llama")
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    data = write_set(tmp_path / "train.jsonl")
    out = tmp_path / "enc"
    summary = distill(DistillConfig(data=str(data), out=str(out), steps=30, lr=1e-2,
                                    soft_tokens=soft, lora_rank=rank, warmup=1,
                                    context_tokens=context),
                      loaded=loaded, log=lambda m: None)
    assert LearnedEncoding.load(out / "encoder.safetensors").meta["context_tokens"] == context
    assert summary["final_loss"] < summary["first_loss"]
    # the model is untouched: only the encoder file holds what was learned
    assert all(torch.equal(before[k], v) for k, v in loaded.model.state_dict().items())
    engine = TurboRAGEngine(loaded, store=str(tmp_path / "kv"), progress=False,
                            encoder=str(out / "encoder.safetensors"))
    assert engine.learned.num_soft == soft and len(engine.learned.lora) == (14 if rank else 0)
    assert engine.library.encoder.base_position == len(engine.library.encoder.anchor_ids) + soft


def test_training_contexts_are_built_as_ingestion_builds_them():
    """Each chunk's training context is what `context_token_ids` makes of a document's text
    before it: either the item's chunks before it (one document in prompt order) or paragraphs
    of other items, never the chunk's own item; at most the limit; both kinds occur."""
    tok = tiny_model("llama").tokenizer
    others = ["The lighthouse keeper rows to town on Fridays.", "Dora sells maps of the coast.",
              "The mill on the hill grinds rye."]
    kinds = set()
    for seed in range(16):
        ctx = training_contexts(tok, CHUNKS, CHUNKS + others, 20, random.Random(seed))
        assert len(ctx) == len(CHUNKS) and all(len(c) <= 20 for c in ctx)
        ordered = [context_token_ids(tok, "\n\n".join(CHUNKS[:i]), 20, CHUNKS[i])
                   for i in range(len(CHUNKS))]
        if ctx == ordered:
            kinds.add("ordered")
            assert ctx[0] == [] and all(ctx[1:])
        else:
            kinds.add("other")
            for c in ctx:
                text = tok.decode(c)
                assert not any(chunk[:12] in text for chunk in CHUNKS)
    assert kinds == {"ordered", "other"}


def test_rejects_nothing_to_train(tmp_path):
    with pytest.raises(ValueError, match="soft tokens"):
        distill(DistillConfig(data=str(write_set(tmp_path / "t.jsonl")), out=str(tmp_path / "o"),
                              soft_tokens=0, lora_rank=0), loaded=tiny_model("llama"))


def test_training_set_sharing_items_with_an_eval_set_is_refused(tmp_path):
    train = write_set(tmp_path / "train.jsonl", prefix="train")
    evals = tmp_path / "eval.jsonl"
    rows = [{"id": "e1", "question": "Something else entirely?", "answers": ["x"],
             "chunks": ["Unrelated text about ships."]},
            {"id": "e2", "question": "Another question?", "answers": ["Bob"],
             "chunks": ["Other words.", CHUNKS[1]]}]
    evals.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=r"e2 \(eval.jsonl\) ~ train"):
        check_disjoint(load_items(train).items, [evals])
    rows.pop()
    evals.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    check_disjoint(load_items(train).items, [evals])  # disjoint: accepted


def test_bundled_hand_written_sets_are_disjoint_from_each_other_and_the_mix():
    from turborag_integrations.evaluation.cli import DEVSET, HANDDEV, HELDOUT

    dev = load_items(HANDDEV)
    assert not dev.errors and len(dev.items) >= 60
    assert sum(it.unanswerable for it in dev.items) >= 6
    check_disjoint(dev.items, [HELDOUT])
    check_disjoint(load_items(DEVSET / "train.jsonl").items, [HANDDEV, HELDOUT])


def test_finetune_command_refuses_overlap(tmp_path):
    from typer.testing import CliRunner

    from turborag_integrations.cli import app

    data = tmp_path / "leak.jsonl"
    from turborag_integrations.evaluation.cli import HELDOUT

    first = HELDOUT.read_text().splitlines()[0]
    data.write_text(first + "\n")
    result = CliRunner().invoke(app, ["finetune", str(tmp_path / "o"), "--data", str(data),
                                      "--encoder"])
    assert result.exit_code == 2 and "h001 (heldout.jsonl)" in result.output


def test_init_continues_an_encoder_and_refuses_another_shape(tmp_path):
    from turborag_integrations.core.prefill.encoding import LearnedEncoding

    loaded = tiny_model("llama")
    data = str(write_set(tmp_path / "train.jsonl"))
    first = tmp_path / "a"
    distill(DistillConfig(data=data, out=str(first), steps=5, lr=1e-2, soft_tokens=2,
                          lora_rank=4, warmup=1), loaded=loaded, log=lambda m: None)
    start = LearnedEncoding.load(first / "encoder.safetensors")
    second = tmp_path / "b"
    distill(DistillConfig(data=data, out=str(second), steps=3, lr=1e-2, soft_tokens=2,
                          lora_rank=4, warmup=1, init=str(first / "encoder.safetensors")),
            loaded=loaded, log=lambda m: None)
    cont = LearnedEncoding.load(second / "encoder.safetensors")
    assert cont.meta["steps"] == 8 and cont.meta["continued_from"] == "encoder.safetensors"
    assert cont.soft.shape == start.soft.shape and not torch.equal(cont.soft, start.soft)
    with pytest.raises(ValueError, match="2 soft tokens and LoRA rank 4"):
        distill(DistillConfig(data=data, out=str(tmp_path / "c"), steps=1, soft_tokens=4,
                              lora_rank=4, init=str(first / "encoder.safetensors")),
                loaded=loaded, log=lambda m: None)
