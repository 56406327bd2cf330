"""Run inside vLLM's venv: the connector under tensor parallelism (2 ranks on CPU).

    .venv-vllm/bin/python tests/vllm/tensor_parallel.py TOKENIZER_DIR WORK_DIR OUT.json

The bundled SmolLM2 has 3 KV heads, which 2 ranks cannot split, so this builds a small
random-weight llama with 4 KV heads (SmolLM2's tokenizer, float32, saved as a folder), ingests
chunks with the HF engine (every KV head in each blob), and answers the same stitched prompt
with vLLM at tensor_parallel_size 2: each rank writes its own two heads of every blob
(vllm/heads.py). The same vLLM (kv_both) then ingests the chunks into a tenant's namespace:
each rank reads its two heads, and rank 0 stores them gathered; the blobs are compared with
ChunkEncoder's. Writes one JSON object; tests/vllm/test_vllm_tensor_parallel.py asserts on it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# one core per rank ("|" separates the ranks' bindings)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) <= 2 else "auto")

NEW_TOKENS = 16
KV_HEADS = 4

HEAD = "<|im_start|>user\nContext:\n"
CHUNKS = [
    "The Varnholt bridge was completed in 1911 by the engineer Mira Szabo, who chose a steel "
    "truss because the river floods every spring.\n",
    "Lake Orrin freezes every winter; its ice festival began in 1954 and now draws ten thousand "
    "visitors in a single weekend.\n",
    "Harbour records show the ferry Aldine sank in 1932 with no loss of life; its bell hangs in "
    "the town hall today.\n",
]
PROMPT = HEAD + "".join(CHUNKS) + "Question: When did the Aldine sink?<|im_end|>\n<|im_start|>assistant\n"


def build_model(tokenizer_dir: str, target: Path) -> Path:
    """A 4-layer llama with 8 query and 4 KV heads over SmolLM2's tokenizer, random weights.

    initializer_range 0.2 rather than 0.02: logits of a random model at the default are nearly
    flat, and greedy ties would turn on the last bit of a sum, which two ranks add in another
    order."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                         initializer_range=0.2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main(tokenizer_dir: str, work: str, out_path: str) -> None:
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prefill.stitch import plan_prompt
    from turborag_integrations.core.settings import GenerationConfig

    work_dir = Path(work)
    model_dir = build_model(tokenizer_dir, work_dir / "model")
    store = work_dir / "store"
    shutil.rmtree(store, ignore_errors=True)
    engine = TurboRAGEngine(str(model_dir), store=str(store), encoder="none", progress=False,
                            recovery="none")  # the connector stitches alone
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.encode_chunks(CHUNKS)
    turbo = engine.generate(PROMPT, chunks=CHUNKS, config=config)
    naive = engine.generate(PROMPT, config=config, mode="naive")
    segments, _, _ = engine.assembly.segments(PROMPT, CHUNKS)
    plan = plan_prompt(segments, engine.tokenizer)
    results: dict = {"hf": {"turbo": turbo.token_ids, "naive": naive.token_ids,
                            "reused": turbo.stats.reused_tokens,
                            "same_ids": engine.tokenizer(PROMPT, add_special_tokens=False)[
                                "input_ids"] == plan.token_ids,
                            "kv_heads": int(engine.store.get(engine.library.chunk_key(CHUNKS[0]))
                                            .keys.shape[1])}}

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="TurboRAGConnector",
        kv_connector_module_path="turborag_integrations.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": str(store), "encoder": "none", "refresh_s": 0})
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, kv_transfer_config=ktc,
              tensor_parallel_size=2, max_model_len=1024, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(salt=None) -> dict:
        prompt = {"prompt_token_ids": plan.token_ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "params": out.kv_transfer_params}

    results["vllm_stitched"] = run("turborag")
    results["vllm_plain"] = run()
    results["tensor_parallel_size"] = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size

    # ingestion through the two ranks, into namespace "acme" (the default one holds these
    # chunks already, from ChunkEncoder)
    from turborag_integrations.core.store import KVStore
    from turborag_integrations.vllm.ingest import chunk_prompt, ingest_params

    params = [SamplingParams(temperature=0, max_tokens=1, extra_args={
        "kv_transfer_params": ingest_params("acme")}) for _ in CHUNKS]
    outs = llm.generate([{"prompt_token_ids": chunk_prompt(engine.tokenizer, t)} for t in CHUNKS],
                        params, use_tqdm=False)
    results["ingested"] = [((o.kv_transfer_params or {}).get("turborag") or {}).get("ingest", {})
                           for o in outs]
    made = KVStore(str(store), remote_url="", memory_bytes=0).namespace("acme")
    compare = []
    for text in CHUNKS:
        theirs = engine.store.get(engine.library.chunk_key(text), engine.fingerprint)
        ours = made.get(engine.namespaced("acme").library.chunk_key(text), engine.fingerprint)
        compare.append({"found": ours is not None,
                        "shape": ours is not None and ours.keys.shape == theirs.keys.shape,
                        "keys_max_abs": None if ours is None else
                        float((ours.keys - theirs.keys).abs().max()),
                        "values_max_abs": None if ours is None else
                        float((ours.values - theirs.values).abs().max()),
                        "keys_scale": float(theirs.keys.abs().max()),
                        "values_scale": float(theirs.values.abs().max()),
                        "heads_swapped_max_abs": None if ours is None else float(
                            (ours.keys[:, [2, 3, 0, 1]] - theirs.keys).abs().max())})
    results["compare"] = compare
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(*sys.argv[1:4])
