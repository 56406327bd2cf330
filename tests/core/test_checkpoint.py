"""A model's fingerprint from its checkpoint folder equals the loaded model's (core/checkpoint.py).

vLLM's connector computes blob fingerprints this way, with no HF copy of the model: any
difference would leave every stored blob unfound."""

from __future__ import annotations

import pytest
import torch

from turborag_integrations.core.checkpoint import (
    CheckpointError,
    checkpoint_weights_digest,
    fingerprint_checkpoint,
)
from turborag_integrations.core.kv.blob import fingerprint_model
from turborag_integrations.core.models import load_model
from tests.conftest import tiny_model


def saved(tmp_path, model_type: str, *, tied: bool, shard: str | None = None):
    loaded = tiny_model(model_type)
    loaded.model.config.tie_word_embeddings = tied
    if tied:
        loaded.model.tie_weights()
    folder = tmp_path / f"{model_type}-{'tied' if tied else 'untied'}"
    kwargs = {"max_shard_size": shard} if shard else {}
    loaded.model.save_pretrained(folder, **kwargs)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model_type,tied,shard", [("llama", False, None), ("llama", True, None),
                                                   ("qwen2", False, "40KB")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_checkpoints_fingerprint_is_the_loaded_models(tmp_path, model_type, tied, shard, dtype):
    folder = saved(tmp_path, model_type, tied=tied, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").exists()  # several files, one index
    reloaded = load_model(str(folder), dtype=dtype, progress=False)
    assert fingerprint_checkpoint(folder, dtype, "m") == \
        fingerprint_model(reloaded.model, reloaded.tokenizer, "m")


def test_the_bundled_models_checkpoint_gives_its_fingerprint(smollm2):
    assert fingerprint_checkpoint(smollm2.source, "float32", smollm2.name) == \
        fingerprint_model(smollm2.model, smollm2.tokenizer, smollm2.name)


def test_one_changed_weight_or_another_dtype_changes_the_digest(tmp_path):
    folder = saved(tmp_path, "llama", tied=False)
    config = load_model(str(folder), progress=False).model.config
    before = checkpoint_weights_digest(folder, torch.float32, config)
    assert checkpoint_weights_digest(folder, torch.bfloat16, config) != before
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][3] += 1e-3
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_weights_digest(folder, torch.float32, config) != before


def test_a_folder_without_safetensors_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights: convert"):
        checkpoint_weights_digest(tmp_path, torch.float32, None)
