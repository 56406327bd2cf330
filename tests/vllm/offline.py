"""Run inside vLLM's venv: the connector built without an engine, for the paths where TurboRAG
must switch itself off (vLLM then serves every request causally), and for when its scheduler
needs an HF copy of the model (only to encode a prompt head or separator nobody stored).

    .venv-vllm/bin/python tests/vllm/offline.py MODEL_DIR STORE OUT.json
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from turborag_integrations.vllm.connector import TurboRAGConnector


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def connector(model_dir: str, store: str, hf_config=None, *, role: str = "kv_consumer",
              tensor_parallel: int = 1, **extra) -> TurboRAGConnector:
    """The scheduler's connector, built as vLLM builds it at startup."""
    ktc = KVTransferConfig(kv_connector="TurboRAGConnector", kv_role=role,
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"store": store, "refresh_s": 0, **extra})
    config = SimpleNamespace(
        kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=128),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel),
        model_config=SimpleNamespace(model=model_dir, dtype=torch.float32,
                                     hf_config=hf_config or AutoConfig.from_pretrained(model_dir)))
    return TurboRAGConnector(config, KVConnectorRole.SCHEDULER, None)


def request(ids, salt):
    return SimpleNamespace(request_id="r", prompt_token_ids=ids, cache_salt=salt)


CHUNKS = [
    "The Varnholt bridge was completed in 1911 by the engineer Mira Szabo, who chose a steel "
    "truss because the river floods every spring.\n",
    "Harbour records show the ferry Aldine sank in 1932 with no loss of life; its bell hangs in "
    "the town hall today.\n",
]


def prompt_ids(tokenizer, head: str) -> list[int]:
    """A prompt's ids by the tokenizer alone (the HF engine's segments() would store its head)."""
    text = head + "".join(CHUNKS) + "Question: When did the Aldine sink?<|im_end|>\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def model_free(model_dir: str, store: str) -> dict:
    """A scheduler started on a store that holds the separators, and a request whose head and
    chunks are stored: claimed with no model loaded; a new head loads it."""
    # an empty store: the separators need the model
    first = connector(model_dir, store).connector_scheduler
    out = {"first_loaded_at_start": first.setup.loaded}
    engine = first.setup.engine
    engine.encode_chunks(CHUNKS)
    seen = prompt_ids(engine.tokenizer, "<|im_start|>user\nContext:\n")
    out["first_claim"] = first.get_num_new_matched_tokens(request(seen, "turborag"), 0)
    second = connector(model_dir, store).connector_scheduler
    out["second_loaded_at_start"] = second.setup.loaded
    out["same_fingerprints"] = (second.chunk_fp == engine.fingerprint
                                and second.prefix_fp == engine.library.prefix_fingerprint)
    out["second_claim"] = second.get_num_new_matched_tokens(request(seen, "turborag"), 0)
    out["second_loaded_after_stored_head"] = second.setup.loaded
    new_head = prompt_ids(engine.tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    out["new_head_claim"] = second.get_num_new_matched_tokens(request(new_head, "turborag"), 0)
    out["second_loaded_after_new_head"] = second.setup.loaded
    return out


def main(model_dir: str, store: str, out: str) -> None:
    records = Records()
    logging.getLogger("turborag.vllm").addHandler(records)
    results = {}
    ids = list(range(5, 60))

    ok = connector(model_dir, store)
    results["enabled"] = {"on": ok.connector_scheduler.enabled,
                          "no_salt": ok.get_num_new_matched_tokens(request(ids, None), 0),
                          "other_salt": ok.get_num_new_matched_tokens(request(ids, "tenant-a"), 0)}

    longrope = AutoConfig.from_pretrained(model_dir)
    longrope.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0,
                                "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                "original_max_position_embeddings": 256}
    off = connector(model_dir, store, longrope)
    results["longrope"] = {"on": off.connector_scheduler.enabled,
                           "claim": off.get_num_new_matched_tokens(request(ids, "turborag"), 0)}

    bad = connector(model_dir, str(Path("/dev/null") / "store"))
    results["bad_store"] = {"on": bad.connector_scheduler.enabled,
                            "claim": bad.get_num_new_matched_tokens(request(ids, "turborag"), 0)}
    results["model_free"] = model_free(model_dir, store + "-model-free")
    results["log"] = records.messages
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
