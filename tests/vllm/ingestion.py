"""Run inside vLLM's venv: chunk blobs made by vLLM's own prefill (the connector's save side,
kv_both), against ChunkEncoder's.

    .venv-vllm/bin/python tests/vllm/ingestion.py MODEL_DIR OUT.json

One vLLM (float32, encoder none, the chat anchor, 32 context tokens) ingests the chunks, one
of them after its context (replacing the blob an HF engine encoded alone); the HF engine
encodes the same chunks with ChunkEncoder into another store; both stores' blobs and the
answers stitched from them are compared. Writes one JSON object; tests/vllm/test_vllm_ingestion.py asserts on it.
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
from exactness import CHUNKS, HEAD, NEW_TOKENS, question  # noqa: E402

# longer than two of vLLM's CPU blocks (128 tokens): computed over several steps (at most
# BATCH_TOKENS a step), and read back partly from vLLM's prefix cache when ingested again
LONG = (
    "The Greywater canal was cut between 1791 and 1803 to carry slate from the Brenn quarries "
    "to the sea. It climbs 96 metres through a flight of twenty-two locks at Holloway, each "
    "worked by hand, and crosses the river Tamm on a stone aqueduct of nine arches designed by "
    "the surveyor Elias Marrow. Horse-drawn boats took two days from the quarries to the port "
    "of Saltmouth, where the slate was loaded onto coastal ships bound for the growing towns of "
    "the north. Trade peaked in 1860, when more than four hundred boats were registered on the "
    "canal, and declined after the railway reached Brenn in 1874. The last commercial cargo, a "
    "load of roofing slate, passed through Holloway in 1931. A volunteer trust formed in 1968 "
    "restored the locks one by one; the flight reopened to pleasure boats in 1994, and the "
    "aqueduct was listed as a monument in 2001. Today the towpath is a footpath and cycle route "
    "of forty kilometres, and the old lock-keeper's cottage at the top of the flight houses a "
    "small museum of canal life, open on weekends from April to October.\n")
BATCH_TOKENS = 128
# the connector and the HF engine encode chunks after up to this many tokens of the text before
# them; AFTER is ingested after CHUNKS[0], the other chunks with no context
CONTEXT_TOKENS = 32
AFTER = "After the bridge opened, tolls were collected at its east end until 1902.\n"


def main(model_dir: str, out_path: str) -> None:
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prefill.stitch import plan_prompt
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.core.store import KVStore
    from turborag_integrations.core.prefill.context import context_token_ids
    from turborag_integrations.vllm.ingest import chunk_prompt, ingest_params

    from offline import connector

    results: dict = {}
    # refused at startup, as vLLM builds the scheduler's connector: the bundled model's learned
    # encoder (what "encoder" defaults to), and two tensor-parallel ranks over 3 KV heads
    for name, kwargs in (("learned", {}), ("tensor_parallel", {"tensor_parallel": 2,
                                                                "encoder": "none"})):
        try:
            connector(model_dir, tempfile.mkdtemp(), role="kv_both", **kwargs)
            results[f"{name}_refused"] = None
        except ValueError as exc:
            results[f"{name}_refused"] = str(exc)

    vllm_store, hf_store = tempfile.mkdtemp(prefix="vllm-made-"), tempfile.mkdtemp(prefix="hf-")
    engine = TurboRAGEngine(model_dir, store=hf_store, encoder=None, progress=False,
                            context_tokens=CONTEXT_TOKENS, recovery="none")
    texts = CHUNKS + [LONG]
    prompts = [chunk_prompt(engine.tokenizer, t) for t in texts]

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="TurboRAGConnector",
        kv_connector_module_path="turborag_integrations.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": vllm_store, "encoder": "none", "refresh_s": 0,
                                   "context_tokens": CONTEXT_TOKENS})
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_transfer_config=ktc,
              max_model_len=2048, max_num_batched_tokens=BATCH_TOKENS, seed=0)

    def ingest(requests):
        """[(prompt ids, kv_transfer_params)] → each request's result and prefix-cache hits."""
        params = [SamplingParams(temperature=0, max_tokens=1, extra_args={
            "kv_transfer_params": p}) for _, p in requests]
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], params,
                            use_tqdm=False)
        return [{**((o.kv_transfer_params or {}).get("turborag") or {}).get("ingest", {}),
                 "cached_tokens": o.num_cached_tokens or 0} for o in outs]

    anchor = len(engine.library.encoder.anchor_ids)
    batch = [(ids, ingest_params()) for ids in prompts]
    batch.append((prompts[0], ingest_params("acme", "doc-1")))  # a tenant's, with its document
    batch.append((prompts[1][anchor:], ingest_params()))  # no anchor: refused
    first = ingest(batch)
    results["ingested"] = first[:len(texts)]
    results["tenant"] = first[len(texts)]
    results["no_anchor"] = first[len(texts) + 1]
    results["again"] = ingest([(prompts[1], ingest_params())])[0]
    # AFTER was retrieved before its document was ingested: an HF engine on the same store
    # encoded it alone, at query time; the ingestion after its context replaces that blob
    from_vllm = TurboRAGEngine(engine.loaded, store=vllm_store, encoder=None, progress=False,
                               context_tokens=CONTEXT_TOKENS, recovery="none")
    from_vllm.library.prepare_chunks([AFTER])
    results["alone_base_position"] = from_vllm.library.blob_for(AFTER).base_position
    context = context_token_ids(engine.tokenizer, CHUNKS[0], CONTEXT_TOKENS)
    results["context_len"] = len(context)
    results["context_ingested"] = ingest([(
        engine.library.encoder.anchor_ids + context + engine.library.encoder.tokenize(AFTER),
        ingest_params(context_len=len(context)))])[0]

    # a lead blob: the first chunk right after HEAD (in a namespace of its own, so that the
    # answers below stitch the usual blobs), as an engine told that head encodes it
    from turborag_integrations.core.library import head_ids

    lead_head = head_ids(engine.tokenizer, HEAD)
    results["lead_ingested"] = ingest([(lead_head + engine.library.encoder.tokenize(CHUNKS[0]),
                                        ingest_params("leads", head_len=len(lead_head)))])[0]

    # the HF engine's ChunkEncoder, same model, dtype and encoding, into its own store
    hf_keys = engine.encode_chunks(texts)
    hf_keys += engine.encode_chunks([AFTER], contexts=[CHUNKS[0]])
    made = KVStore(vllm_store, remote_url="", memory_bytes=0)
    fp = engine.fingerprint
    compare = []
    for text, key in zip(texts + [AFTER], hf_keys):
        ours, theirs = made.get(key, fp), engine.store.get(key, fp)
        same = ours is not None
        compare.append({
            "found": same,
            "fingerprint": same and ours.fingerprint == theirs.fingerprint,
            "base_position": ours.base_position if same else None,
            "hf_base_position": theirs.base_position,
            "token_ids": same and ours.token_ids.tolist() == theirs.token_ids.tolist(),
            "shape": same and ours.keys.shape == theirs.keys.shape,
            "keys_max_abs": float((ours.keys - theirs.keys).abs().max()) if same else None,
            "values_max_abs": float((ours.values - theirs.values).abs().max()) if same else None,
            "keys_scale": float(theirs.keys.abs().max()),
            "values_scale": float(theirs.values.abs().max())})
    results["compare"] = compare[:len(texts)]
    results["context_compare"] = compare[len(texts)]
    # what a wrong encoding would differ by: the first chunk's values encoded with no anchor
    [plain] = engine.library.prefix_encoder.encode_ids([engine.library.encoder.tokenize(texts[0])])
    results["values_max_abs_without_anchor"] = float(
        (plain.values - engine.store.get(hf_keys[0], fp).values).abs().max())
    results["hf_keys"] = hf_keys[:len(texts)]
    results["context_hf_key"] = hf_keys[-1]
    results["anchor_len"] = anchor
    results["tenant_hf_key"] = engine.namespaced("acme").library.chunk_key(texts[0])
    results["tenant_stored"] = made.namespace("acme").contains(results["tenant_hf_key"])
    results["tenant_doc_keys"] = made.namespace("acme").disk.keys_of_doc("doc-1")

    # the long chunk again, its blob deleted: vLLM's prefix cache holds its first full blocks,
    # which the worker reads back like computed ones
    long_key = hf_keys[len(texts) - 1]
    before = made.get(long_key, fp)
    made.delete(long_key)
    again = ingest([(prompts[-1], ingest_params())])[0]
    after = made.get(long_key, fp)
    results["from_prefix_cache"] = {
        **again, "prompt_tokens": len(prompts[-1]),
        "max_abs_vs_first": None if after is None else max(
            float((after.keys - before.keys).abs().max()),
            float((after.values - before.values).abs().max()))}

    # answers stitched from either store's blobs: the HF engine's turbo mode, and vLLM's
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    answers = {}
    for name, chunks, q in (("three", CHUNKS[:3], "Who completed the Varnholt bridge, and when?"),
                            ("long", [LONG, CHUNKS[3]], "When did the canal reopen?")):
        prompt = HEAD + "".join(chunks) + question(q)
        hf = engine.generate(prompt, chunks=chunks, config=config)
        ours = from_vllm.generate(prompt, chunks=chunks, config=config)
        segments, _, _ = engine.assembly.segments(prompt, chunks)
        ids = plan_prompt(segments, engine.tokenizer).token_ids
        out = llm.generate([{"prompt_token_ids": ids, "cache_salt": "turborag"}],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                           use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason == "stop" and tokens and tokens[-1] in engine.eos_ids:
            tokens.pop()  # vLLM returns the end-of-sequence token, the HF engine does not
        answers[name] = {"hf": hf.token_ids, "hf_from_vllm_blobs": ours.token_ids,
                         "hf_hits": hf.stats.cache_hits, "hits_from_vllm_blobs":
                         ours.stats.cache_hits, "vllm": tokens,
                         "vllm_params": out.kv_transfer_params, "chunks": len(chunks),
                         "text": engine.tokenizer.decode(hf.token_ids)}
    results["answers"] = answers

    told = TurboRAGEngine(engine.loaded, store=tempfile.mkdtemp(prefix="hf-leads-"),
                          encoder=None, progress=False, context_tokens=CONTEXT_TOKENS,
                          prompt_heads=[HEAD], recovery="none")
    told.encode_chunks(CHUNKS[:1])
    [theirs] = [b for b in map(told.store.get, told.store.keys()) if told.library.is_lead(b)]
    space = made.namespace("leads")
    key = space.key(theirs.fingerprint, theirs.token_ids.tolist())  # the HF blob's, in "leads"
    ours = space.get(key, theirs.fingerprint)
    results["lead_compare"] = {
        "hf_key": key, "found": ours is not None,
        "base_position": ours.base_position if ours else None,
        "hf_base_position": theirs.base_position,
        "keys_max_abs": float((ours.keys - theirs.keys).abs().max()) if ours else None,
        "values_max_abs": float((ours.values - theirs.values).abs().max()) if ours else None}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1], sys.argv[2])
