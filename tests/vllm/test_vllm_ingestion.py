"""Ingestion on vLLM (the connector's save side, kv_both) against ChunkEncoder, in a real vLLM.

ingestion.py runs once in vLLM's venv (one vLLM start); these tests read what it measured.
Without that venv they skip, unless TURBORAG_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json

import pytest

from .test_vllm_connector import require_vllm, run_in_vllm

# vLLM's CPU attention kernel and HF's sdpa round differently, and the difference compounds over
# 30 layers: measured at most 8.2e-5 on keys and 4.2e-5 on values here, 8.5e-5 and 3.6e-5
# through the OpenAI server at vLLM's default batch size (float32; keys reach ±19, values ±13:
# a few tens of float32 ulps). 5e-4 leaves room for other batch compositions; a wrong encoding
# (the first chunk without its anchor) differs by 5.0.
TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    require_vllm()
    from turborag_integrations.core.bundled import prepare_bundled

    model_dir = prepare_bundled("smollm2-135m-instruct", progress=False)
    out = tmp_path_factory.mktemp("vllm-ingest") / "ingested.json"
    run_in_vllm("ingestion.py", model_dir, out)
    return json.loads(out.read_text())


def test_vllm_stores_every_chunk_under_chunk_encoders_key(ingested):
    assert [r["key"] for r in ingested["ingested"]] == ingested["hf_keys"]
    assert all(r["stored"] and not r["existing"] for r in ingested["ingested"])
    assert ingested["ingested"][-1]["tokens"] > 2 * 128  # the long chunk spans three blocks


def test_vllm_made_blobs_equal_chunk_encoders(ingested):
    for case in ingested["compare"]:
        assert case["found"] and case["fingerprint"] and case["token_ids"] and case["shape"]
        assert case["base_position"] == case["hf_base_position"] > 0  # after the chat anchor
        assert case["keys_max_abs"] <= TOLERANCE and case["values_max_abs"] <= TOLERANCE
    assert ingested["values_max_abs_without_anchor"] > 1  # the tolerance tells encodings apart


def test_a_chunk_ingested_after_its_context_equals_chunk_encoders(ingested):
    """A request of anchor + context + chunk, its context length in kv_transfer_params, stores
    the blob the HF engine encodes for that chunk after that text, in place of the blob
    encoded alone that was stored under its key."""
    made = ingested["context_ingested"]
    assert made["stored"] and made["key"] == ingested["context_hf_key"]
    assert made["replaced"] and not made["existing"]
    assert ingested["alone_base_position"] == ingested["anchor_len"]
    case = ingested["context_compare"]
    assert case["found"] and case["fingerprint"] and case["token_ids"] and case["shape"]
    assert ingested["context_len"] == 32
    assert case["base_position"] == case["hf_base_position"] == ingested["anchor_len"] + 32
    assert case["keys_max_abs"] <= TOLERANCE and case["values_max_abs"] <= TOLERANCE


def test_answers_stitched_from_vllm_made_blobs_equal_chunk_encoders(ingested):
    for case in ingested["answers"].values():
        assert case["hits_from_vllm_blobs"] == case["hf_hits"] == case["chunks"]
        assert case["hf_from_vllm_blobs"] == case["hf"]  # TurboRAGEngine turbo, encoder none
        # and vLLM claims its own blobs back, with the same answer
        assert case["vllm_params"]["turborag"]["spans"] == case["chunks"] + 1  # and the head
        assert case["vllm"] == case["hf"]


def test_prefix_cache_hits_are_read_back_like_computed_blocks(ingested):
    case = ingested["from_prefix_cache"]
    assert case["stored"] and case["cached_tokens"] >= 2 * 128
    assert case["max_abs_vs_first"] is not None and case["max_abs_vs_first"] <= TOLERANCE


def test_a_stored_chunk_is_not_written_again(ingested):
    case = ingested["again"]
    assert case["stored"] and case["existing"] and case["key"] == ingested["hf_keys"][1]


def test_a_tenants_chunk_goes_into_its_namespace_with_its_document(ingested):
    case = ingested["tenant"]
    assert case["stored"] and case["key"] == ingested["tenant_hf_key"]
    assert ingested["tenant_stored"] and ingested["tenant_doc_keys"] == [case["key"]]


def test_a_prompt_without_the_anchor_is_refused_with_the_reason(ingested):
    case = ingested["no_anchor"]
    assert "does not start with the" in case["error"] and "anchor" in case["error"]
    assert "stored" not in case


def test_kv_both_with_the_learned_encoder_refuses_at_startup(ingested):
    message = ingested["learned_refused"]
    assert message and "learned" in message and '"encoder": "none"' in message


def test_kv_both_refuses_ranks_that_do_not_split_the_kv_heads(ingested):
    # SmolLM2's 3 KV heads over 2 ranks (2 ranks over 4 heads ingest: test_vllm_tensor_parallel)
    message = ingested["tensor_parallel_refused"]
    assert message and "tensor_parallel_size 2 over 3 KV heads" in message
    assert "divides the KV heads" in message


def test_a_lead_blob_ingested_on_vllm_equals_the_engines(ingested):
    """head + chunk with turborag_head_len stores the lead blob an HF engine told that head
    encodes: same key (the head's encoding), position and, within tolerance, KV."""
    made, case = ingested["lead_ingested"], ingested["lead_compare"]
    assert made["stored"] and made["lead"] and made["key"] == case["hf_key"]
    assert case["found"] and case["base_position"] == case["hf_base_position"] > 0
    assert case["keys_max_abs"] <= TOLERANCE and case["values_max_abs"] <= TOLERANCE
