"""The connector's settings (vllm/config.py), without vLLM: `kv_connector_extra_config` read once,
with the connector's defaults, and every key or value it cannot use refused with what it takes."""

from __future__ import annotations

import dataclasses

import pytest

from turborag_integrations.core.store import KVStore
from turborag_integrations.vllm.config import ConnectorConfig
from turborag_integrations.vllm.launch import kv_transfer_config


def test_only_the_store_is_required_and_the_rest_keeps_the_connectors_defaults():
    assert ConnectorConfig.from_extra_config({"store": "/kv"}) == ConnectorConfig(
        store="/kv", store_dir=None, encoder="default", anchor="chat", context_tokens=1024,
        min_chunk_tokens=8, salt_prefix="turborag", public=True, refresh_s=2.0,
        max_head_tokens=512, blob_dtype=None)


def test_every_key_turborag_vllm_writes_is_read():
    extra = kv_transfer_config("/kv", encoder="none", anchor="bos", min_chunk_tokens=16,
                               store_dir="/disk", blob_dtype="float32", ingest=True,
                               context_tokens=32)["kv_connector_extra_config"]
    config = ConnectorConfig.from_extra_config(extra)
    assert (config.store, config.encoder, config.anchor, config.min_chunk_tokens,
            config.store_dir, config.blob_dtype, config.context_tokens) == (
        "/kv", "none", "bos", 16, "/disk", "float32", 32)


def test_the_other_keys_and_null_encodings():
    config = ConnectorConfig.from_extra_config({
        "store": "/kv", "salt_prefix": "rag", "public": False, "refresh_s": 0,
        "max_head_tokens": 0, "encoder": None, "anchor": None, "blob_dtype": "torch.bfloat16"})
    assert (config.salt_prefix, config.public, config.refresh_s, config.max_head_tokens) == (
        "rag", False, 0, 0)
    assert config.encoder is None and config.anchor is None  # training-free, no anchor
    assert config.blob_dtype == "bfloat16"  # as vLLM's dtype reads without its "torch."


@pytest.mark.parametrize("extra", [None, {}, {"store": ""}, {"encoder": "none"}])
def test_without_a_store_it_says_where_the_blobs_go(extra):
    with pytest.raises(ValueError) as raised:
        ConnectorConfig.from_extra_config(extra)
    assert str(raised.value) == ('TurboRAGConnector needs kv_connector_extra_config {"store": '
                                 '"<store folder or redis:// URL>"}: where the chunk blobs are')


def test_an_unknown_key_is_refused_with_the_nearest_one_and_every_key():
    with pytest.raises(ValueError) as raised:
        ConnectorConfig.from_extra_config({"store": "/kv", "min_chunk_token": 16})
    assert str(raised.value) == (
        "TurboRAGConnector: kv_connector_extra_config has no key 'min_chunk_token' (did you "
        'mean "min_chunk_tokens"?); its keys are store, store_dir, encoder, anchor, '
        "context_tokens, min_chunk_tokens, salt_prefix, public, refresh_s, max_head_tokens, "
        "blob_dtype")
    with pytest.raises(ValueError, match=r"no key 'tenant'; its keys are store, "):
        ConnectorConfig.from_extra_config({"store": "/kv", "tenant": "acme"})


@pytest.mark.parametrize("key, value, takes", [
    ("min_chunk_tokens", 4, "a whole number ≥ 8"),  # TokenSpanIndex files blobs by 8 tokens
    ("min_chunk_tokens", "16", "a whole number ≥ 8"),
    ("context_tokens", -1, "a whole number ≥ 0, as TurboRAGEngine takes it"),
    ("context_tokens", True, "a whole number ≥ 0, as TurboRAGEngine takes it"),
    ("max_head_tokens", 1.5, "a whole number ≥ 0"),
    ("refresh_s", -2, "a number of seconds ≥ 0"),
    ("refresh_s", float("nan"), "a number of seconds ≥ 0"),
    ("refresh_s", "2", "a number of seconds ≥ 0"),
    ("public", "false", "true or false"),
    ("public", 0, "true or false"),
    ("salt_prefix", "", "a non-empty text"),
    ("blob_dtype", "fp8", "one of float32, bfloat16, float16, or no key for vLLM's own dtype"),
    ("blob_dtype", "", "one of float32, bfloat16, float16, or no key for vLLM's own dtype"),
    ("anchor", "", "one of chat, bos, none or a non-empty text, as TurboRAGEngine takes it"),
    ("encoder", 3, '"default", "none", a bundled encoder\'s name or the path of one, as '
                   "TurboRAGEngine takes it"),
    ("store_dir", ["/disk"], "a folder: the disk tier in front of a redis:// store"),
    ("store", 5, "a store folder or a redis:// URL"),
])
def test_a_bad_value_is_refused_naming_the_key_and_what_it_takes(key, value, takes):
    with pytest.raises(ValueError) as raised:
        ConnectorConfig.from_extra_config({"store": "/kv", key: value})
    assert str(raised.value) == (f'the connector\'s "{key}" (kv_connector_extra_config) is '
                                 f"{takes}, not {value!r}")


def test_the_config_is_read_once_and_never_changes():
    config = ConnectorConfig(store="/kv")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.refresh_s = 0
    with pytest.raises(ValueError, match='"min_chunk_tokens"'):  # checked however it is made
        ConnectorConfig(store="/kv", min_chunk_tokens=2)


def test_the_store_it_names_is_opened_in_that_folder(tmp_path):
    store = ConnectorConfig(store=str(tmp_path / "kv")).open_store(memory_bytes=0)
    assert isinstance(store, KVStore) and store.root == tmp_path / "kv"
