"""LoRA adapters: merged at load, part of the fingerprint, refused on the wrong model."""

import json

import pytest
import torch

from turborag_integrations.core.adapter import apply_adapter, read_adapter, save_adapter
from turborag_integrations.core.kv.blob import weights_digest
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import AdapterMismatch
from tests.conftest import tiny_model


def _deltas(model, rank=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = model.model.layers[0].self_attn.q_proj.weight
    a = torch.randn(rank, q.shape[1], generator=g) * 0.1
    b = torch.randn(q.shape[0], rank, generator=g) * 0.1
    return {"model.layers.0.self_attn.q_proj": (a, b, 2.0)}


def test_adapter_merges_and_changes_the_fingerprint(tmp_path):
    base = tiny_model("llama")
    path = save_adapter(tmp_path / "a.safetensors", _deltas(base.model), weights_digest(base.model),
                        meta={"base_model": base.name})
    plain = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", adapter=None)
    adapted = TurboRAGEngine(base, store=tmp_path / "kv", adapter=path)
    assert adapted.fingerprint.weights != plain.fingerprint.weights
    assert adapted.fingerprint.id != plain.fingerprint.id
    # the merge is W + scale·B·A, with A and B as stored (float16)
    _, deltas = read_adapter(path)
    a, b, scale = deltas["model.layers.0.self_attn.q_proj"]
    want = plain.model.model.layers[0].self_attn.q_proj.weight + scale * (b.float() @ a.float())
    torch.testing.assert_close(base.model.model.layers[0].self_attn.q_proj.weight, want)
    # a base blob is never served to the adapted engine: same text, another key
    text = "Alice was born in Paris in 1901."
    plain.encode_chunks([text])
    assert adapted.chunk_key(text) != plain.chunk_key(text)
    assert adapted.blob_for(text) is None
    # merging the same file again (a second engine on the same model) is a no-op
    TurboRAGEngine(base, store=tmp_path / "kv", adapter=path)
    assert TurboRAGEngine(base, store=tmp_path / "kv2", adapter=None).fingerprint == \
        TurboRAGEngine(base, store=tmp_path / "kv2", adapter=path).fingerprint


def test_adapter_of_another_model_is_refused_before_any_change(tmp_path):
    base = tiny_model("llama")
    path = save_adapter(tmp_path / "a.safetensors", _deltas(base.model), weights_digest(base.model),
                        meta={"base_model": "tiny-llama-0"})
    other = tiny_model("llama", seed=1)
    before = weights_digest(other.model)
    with pytest.raises(AdapterMismatch, match="trained on other weights.*tiny-llama-0"):
        TurboRAGEngine(other, store=tmp_path / "kv", adapter=path)
    assert weights_digest(other.model) == before


def test_bad_adapter_files_give_clear_errors(tmp_path):
    base = tiny_model("llama")
    with pytest.raises(AdapterMismatch, match="no adapter file"):
        apply_adapter(base.model, tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterMismatch, match="not a readable"):
        apply_adapter(base.model, junk)
    wrong = {"model.layers.9.self_attn.q_proj": next(iter(_deltas(base.model).values()))}
    path = save_adapter(tmp_path / "w.safetensors", wrong, weights_digest(base.model))
    with pytest.raises(AdapterMismatch, match="does not have"):
        apply_adapter(base.model, path)


def test_lora_finetune_writes_an_adapter_the_engine_merges(tmp_path):
    pytest.importorskip("peft")
    from turborag_integrations.training.finetune import FinetuneConfig, finetune
    from turborag_integrations.training.mix import generate_mix

    data = tmp_path / "mix.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in generate_mix(12, seed=3)) + "\n")
    base = tiny_model("llama")
    digest = weights_digest(base.model)
    out = tmp_path / "ft"
    finetune(FinetuneConfig(data=str(data), out=str(out), steps=2, batch_size=2, lr=1e-2,
                            lora=True, lora_rank=4, max_chunks=3),
             loaded=base, log=lambda m: None)
    header, deltas = read_adapter(out / "adapter.safetensors")
    assert header["base_weights"] == digest and len(deltas) == 2 * 7  # 2 layers × 7 projections
    fresh = tiny_model("llama")
    engine = TurboRAGEngine(fresh, store=tmp_path / "kv", adapter=out / "adapter.safetensors")
    assert engine.fingerprint.weights != digest


def test_engines_sharing_a_model_never_merge_a_default_adapter_behind_its_back(tmp_path,
                                                                              monkeypatch):
    """The evaluation harness makes sibling engines (other anchors) on one model: a base-model
    run (adapter=None) must stay the base model even where a default adapter exists."""
    import json as _json

    from turborag_integrations.core import engine as engine_mod
    from turborag_integrations.evaluation.harness import evaluate, load_items

    base = tiny_model("llama")
    path = save_adapter(tmp_path / "a.safetensors", _deltas(base.model), weights_digest(base.model))
    monkeypatch.setattr(engine_mod, "bundled_adapter", lambda name: path)
    engine = TurboRAGEngine(base, store=tmp_path / "kv", adapter=None)
    before = weights_digest(base.model)
    data = tmp_path / "d.jsonl"
    data.write_text(_json.dumps({"id": "a", "question": "Who?", "answers": ["Tamsin"],
                                 "chunks": ["Tamsin did.", "Orrin not."]}))
    evaluate(engine, load_items(data).items, ["naive", "turbo@none", "turbo@bos"],
             max_new_tokens=2)
    assert weights_digest(base.model) == before
