"""Configurations: each concern's dataclass checks its fields once, flat keywords reach the
concern that owns them, an unknown one is refused naming those that exist, and what a config
says is what the engine, the store, RAPID, the server and the loader do."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from turborag_integrations.core.config import EncodingConfig, EngineConfig, QueryConfig
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.models import ModelConfig, load_model
from turborag_integrations.core.prefill.recovery import NO_RECOVERY, parse_recovery
from turborag_integrations.core.rapid import RapidConfig, RapidEngine
from turborag_integrations.core.request import Request
from turborag_integrations.core.settings import GenerationConfig, SpeculationConfig
from turborag_integrations.core.shared import shared_engine
from turborag_integrations.core.store import KVStore, StoreConfig


def test_flat_settings_reach_the_concern_that_owns_them():
    config = EngineConfig().with_settings(device="cpu", context_tokens=0, recovery="none",
                                          question_last=True, prompt_heads=["Q: "])
    assert config.encoding == EncodingConfig(context_tokens=0, prompt_heads=("Q: ",))
    assert config.query.recovery is NO_RECOVERY and config.query.question_last
    assert config.model == ModelConfig()
    assert EngineConfig().with_settings() == EngineConfig()


def test_an_unknown_setting_is_refused_naming_the_settings():
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) 'context'.*context_tokens"):
        EngineConfig().with_settings(context=3)


@pytest.mark.parametrize("fields, says", [
    ({"context_tokens": -1}, "context_tokens must be an integer ≥ 0"),
    ({"batch_size": 0}, "batch_size must be an integer ≥ 1"),
    ({"prompt_heads": "Context: "}, "not one string"),
    ({"prompt_heads": ("",)}, "non-empty string"),
])
def test_a_bad_encoding_is_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        EncodingConfig(**fields)


def test_a_query_config_holds_its_recovery_parsed():
    assert QueryConfig(recovery="select:0.2").recovery == parse_recovery("select:0.2")
    assert str(QueryConfig().recovery) == str(parse_recovery("select:0.15"))
    with pytest.raises(ValueError, match="bad recovery 'select:2'"):
        QueryConfig(recovery="select:2")


def test_the_engine_refuses_a_bad_setting_before_it_loads_anything(monkeypatch):
    from turborag_integrations.core import models

    monkeypatch.setattr(models, "model_source", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(TypeError, match="unknown engine setting"):
        TurboRAGEngine("anything", store_bytes=1)
    with pytest.raises(ValueError, match="bad recovery"):
        TurboRAGEngine("anything", recovery="select:7")


def test_a_config_and_its_flat_spelling_make_the_same_blobs(tmp_path):
    loaded = tiny_model("llama")
    by_config = TurboRAGEngine(loaded, store=tmp_path / "a", progress=False,
                               config=EngineConfig(encoding=EncodingConfig(context_tokens=0)))
    by_name = TurboRAGEngine(loaded, store=tmp_path / "b", progress=False, context_tokens=0,
                             encoder=None)
    assert by_config.config.encoding.context_tokens == by_name.config.encoding.context_tokens == 0
    # the tiny model has no shipped encoder: "default" and None encode alike
    assert by_config.fingerprint.id == by_name.fingerprint.id
    text = "The lighthouse keeper logged 38 metres of visibility."
    a, b = by_config.library.encoder.encode(text), by_name.library.encoder.encode(text)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert by_config.fingerprint.id != TurboRAGEngine(
        loaded, store=tmp_path / "c", progress=False).fingerprint.id  # context encoding differs


def test_rapid_settings_reach_its_rounds_and_its_drafter_context(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path, progress=False)
    rapid = RapidEngine(engine, gamma=3, min_draft_prob=0.5, chunk_tokens=64)
    assert rapid.config.speculation == SpeculationConfig(gamma=3, min_draft_prob=0.5)
    assert rapid.config.chunk_tokens == 64
    with pytest.raises(TypeError, match=r"unknown RAPID setting\(s\) 'gama'.*gamma"):
        RapidEngine(engine, gama=3)
    with pytest.raises(ValueError, match="eta must be a finite number"):
        RapidConfig(speculation=SpeculationConfig(eta=float("inf")))
    with pytest.raises(ValueError, match="compression must be > 0"):
        RapidEngine(engine, compression=0)


def test_store_settings_are_checked_and_kept(tmp_path):
    with KVStore(tmp_path / "kv", memory_bytes=0, storage_dtype="int8") as store:
        assert store.memory is None and store.config.storage_dtype == "int8"
        assert store.storage_dtype == "int8"
        assert store.namespace("tenant").config == store.config
    with pytest.raises(TypeError, match=r"unknown KV store setting\(s\) 'memory'"):
        KVStore(tmp_path / "x", memory=1)
    with pytest.raises(ValueError, match="memory_bytes must be ≥ 0"):
        StoreConfig(memory_bytes=-1)


def test_a_request_checks_its_mode_and_parses_its_recovery():
    request = Request("p", ["c"], recovery="boundary:4", namespace="t", shared=["public"])
    assert request.recovery == parse_recovery("boundary:4") and request.shared == ("public",)
    assert request.chunks == ("c",)
    with pytest.raises(ValueError, match="mode must be one of"):
        Request("p", mode="fast")
    with pytest.raises(ValueError, match="unknown recovery 'fancy'"):
        Request("p", recovery="fancy")


def test_generation_options_are_layered_and_named_as_frameworks_name_them():
    config = GenerationConfig.from_options(
        {"max_tokens": 64, "temperature": 0.7, "stop": None},
        {"max_tokens": 8, "temperature": None, "stop": ["\n\n"]})
    assert config == GenerationConfig(max_new_tokens=8, temperature=0.7, stop=("\n\n",))
    with pytest.raises(TypeError, match="'beams' is not a generation setting"):
        GenerationConfig.from_options({"beams": 2})


def test_from_pretrained_arguments_reach_the_model_and_the_tokenizer(model_dir):
    loaded = load_model(str(model_dir), progress=False, model_kwargs={"pad_token_id": 7},
                        tokenizer_kwargs={"model_max_length": 77})
    assert loaded.model.config.pad_token_id == 7
    assert loaded.tokenizer.model_max_length == 77
    with pytest.raises(ValueError, match="attn_implementation cannot be changed"):
        ModelConfig(model_kwargs={"attn_implementation": "eager"})
    with pytest.raises(ValueError, match="give the dtype as dtype="):
        ModelConfig(model_kwargs={"torch_dtype": "bfloat16"})
    with pytest.raises(TypeError, match="model_kwargs is a dict"):
        ModelConfig(model_kwargs=["pad_token_id"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has an accelerator")
def test_a_device_map_without_an_accelerator_is_refused_before_loading():
    from turborag_integrations.core.errors import ModelError

    with pytest.raises(ModelError, match=r"device_map='auto' places .*\(available here: cpu\)"):
        ModelConfig(model_kwargs={"device_map": "auto"})
    assert ModelConfig(model_kwargs={"device_map": "cpu"}).model_kwargs == {"device_map": "cpu"}


def test_adapters_without_an_engine_share_one_per_model_and_loading(model_dir):
    one = shared_engine(str(model_dir))
    assert shared_engine(str(model_dir), ModelConfig()) is one
    assert shared_engine(str(model_dir), ModelConfig(dtype="bfloat16")) is not one
