"""Shared fixtures: tiny random-weight models (exactness) and the bundled SmolLM2 (real model)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def byte_tokenizer(merges: tuple[tuple[str, str], ...] = ()):
    """A byte-level BPE tokenizer: every UTF-8 byte is one token (plus specials), except the pairs
    in `merges` (byte-level symbols, e.g. ("Ġ", "Ċ") for a space and a newline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                          "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    return fast


def tiny_model(model_type: str = "llama", *, rope_parameters=None, seed: int = 0, layers: int = 2,
               dtype=torch.float32, attn: str = "sdpa", merges=(), context_window: int = 2048):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from turborag_integrations.core.models import LoadedModel

    tokenizer = byte_tokenizer(merges)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=context_window, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    if rope_parameters:
        common["rope_parameters"] = rope_parameters
    config = (LlamaConfig if model_type == "llama" else Qwen2Config)(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    # Random init gives near-uniform logits; scale up so greedy decoding is decisive and a wrong
    # cache shows up as a different token rather than a tie.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
        # Qwen2 has q/k/v biases, which the random init leaves at zero: a path that dropped or
        # misplaced them (before RoPE, in the fast decoder's fused projections, in the int8 and
        # bf16 copies) would go unseen. Real Qwen2 q/k biases are large, so these are not small
        # beside the projections (≈0.2 here). The v bias stays small: it adds the same vector to
        # every attention output, and a large one makes every prompt give the same answer.
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, std in ((attn.q_proj, 0.5), (attn.k_proj, 0.5), (attn.v_proj, 0.05)):
                if proj.bias is not None:
                    proj.bias.normal_(0.0, std)
    if model_type == "qwen2":
        assert all(proj.bias.abs().min() > 0 for layer in model.model.layers
                   for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                layer.self_attn.v_proj))
    return LoadedModel(name=f"tiny-{model_type}-{seed}", model=model, tokenizer=tokenizer,
                       source="memory")


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    from turborag_integrations.core.models import load_model

    return load_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama saved to a folder: a local-folder model for the command line and Workspace."""
    folder = tmp_path_factory.mktemp("tiny-model")
    loaded = tiny_model("llama")
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def write_docs(folder, files: dict[str, str]):
    """`files` (name → text) written into a new folder; returns the folder."""
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder
