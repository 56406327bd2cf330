"""Run inside vLLM's venv: blobs shared through Redis, from an HF ingestion process to vLLM.

    .venv-vllm/bin/python tests/vllm/redis_store.py MODEL_DIR REDIS_URL OUT.json

An HF engine ingests the chunks into a store whose remote tier is REDIS_URL (its own disk tier in
one folder); vLLM then starts with the connector's store set to the same URL and an empty disk
tier of its own, so every blob it claims came through Redis — as a fleet of vLLM instances shares
what one ingestion job wrote. Writes one JSON object; tests/vllm/test_vllm_connector.py asserts
on it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) <= 2 else "auto")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exactness import CHUNKS, ENCODER, HEAD, NEW_TOKENS, question  # noqa: E402


def main(model_dir: str, url: str, out_path: str) -> None:
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prefill.stitch import plan_prompt
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.core.store import KVStore

    ingest_dir, serve_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    engine = TurboRAGEngine(model_dir, store=KVStore(ingest_dir, remote_url=url),
                            encoder=ENCODER, progress=False, recovery="none")
    chunks = CHUNKS[:3]
    engine.encode_chunks(chunks)
    prompt = HEAD + "".join(chunks) + question("Who completed the Varnholt bridge, and when?")
    turbo = engine.generate(prompt, chunks=chunks,
                            config=GenerationConfig(max_new_tokens=NEW_TOKENS))
    segments, _, _ = engine.assembly.segments(prompt, chunks)
    ids = plan_prompt(segments, engine.tokenizer).token_ids
    keys = [engine.library.chunk_key(c) for c in chunks]

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="TurboRAGConnector",
        kv_connector_module_path="turborag_integrations.vllm.connector",
        kv_role="kv_consumer", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": url, "store_dir": serve_dir, "encoder": ENCODER,
                                   "refresh_s": 0})
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_transfer_config=ktc,
              max_model_len=2048, seed=0)
    out = llm.generate([{"prompt_token_ids": ids, "cache_salt": "turborag"}],
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    if out.outputs[0].finish_reason == "stop" and tokens and tokens[-1] in engine.eos_ids:
        tokens.pop()
    # the chunk blobs vLLM's side holds on its own disk were read from Redis, never from the
    # ingesting process's folder
    serve_files = {p.name for p in Path(serve_dir).rglob("*") if p.is_file()}
    Path(out_path).write_text(json.dumps({
        "tokens": tokens, "hf_turbo": turbo.token_ids, "hf_reused": turbo.stats.reused_tokens,
        "params": out.kv_transfer_params,
        "chunk_keys_in_redis": [KVStore(tempfile.mkdtemp(), remote_url=url).contains(k)
                                for k in keys],
        "serve_dir_files": sorted(serve_files)}))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1], sys.argv[2], sys.argv[3])
