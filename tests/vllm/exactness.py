"""Run inside vLLM's venv: the connector against a real vLLM, next to the HF engine.

    .venv-vllm/bin/python tests/vllm/exactness.py MODEL_DIR OUT.json

Writes one JSON object, one entry per case; tests/vllm/test_vllm_connector.py asserts on it.
The HF engine and vLLM run the same model folder in float32, greedy.
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

ENCODER = "smollm2-135m-instruct"  # the bundled chunk encoder: soft tokens, so base_position > 0
NEW_TOKENS = 24

HEAD = ("<|im_start|>system\nAnswer from the context only.<|im_end|>\n<|im_start|>user\n"
        "Context:\n")
CHUNKS = [
    "The Varnholt bridge was completed in 1911 by the engineer Mira Szabo, who chose a steel "
    "truss because the river floods every spring.\n",
    "Lake Orrin freezes every winter; its ice festival began in 1954 and now draws ten thousand "
    "visitors in a single weekend.\n",
    "The town of Keswick Vale exports wool and cheese, and its covered market is held on "
    "Thursdays from dawn until noon.\n",
    "Harbour records show the ferry Aldine sank in 1932 with no loss of life; its bell hangs in "
    "the town hall today.\n",
]


# a head the HF engine is told (`prompt_heads`): the first chunk after it has a lead blob
LEAD_HEAD = ("<|im_start|>system\nUse the context below.<|im_end|>\n<|im_start|>user\n"
             "Context:\n")

# chunks with no trailing newline, joined by "\n\n" (and no stored chunk that contains one)
SEPARATED = [
    "The observatory on Mount Pell opened in 1968 and its largest telescope has a 2.4 metre "
    "mirror ground in the town's own workshop.",
    "Pell's winter road closes in November, so the observers stay on the mountain from then "
    "until the thaw, supplied by a cable car.",
    "In 1987 the observatory's staff discovered the comet that now bears the name of the "
    "director, Ilse Korhonen.",
]


def question(q: str) -> str:
    return f"Question: {q}<|im_end|>\n<|im_start|>assistant\n"


def main(model_dir: str, out_path: str) -> None:
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prefill.stitch import plan_prompt
    from turborag_integrations.core.settings import GenerationConfig

    store = tempfile.mkdtemp(prefix="turborag-vllm-")
    # recovery "none": vLLM's connector stitches alone, so that is the HF answer it must equal
    engine = TurboRAGEngine(model_dir, store=store, encoder=ENCODER, progress=False,
                            recovery="none")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    results: dict = {}

    def hf(prompt: str, chunks: list[str]) -> dict:
        turbo = engine.generate(prompt, chunks=chunks, config=config, encode_missing=True)
        naive = engine.generate(prompt, config=config, mode="naive")
        segments, _, _ = engine.assembly.segments(prompt, chunks)
        plan = plan_prompt(segments, engine.tokenizer)
        whole = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return {"ids": plan.token_ids, "turbo": turbo.token_ids, "naive": naive.token_ids,
                "reused": turbo.stats.reused_tokens, "same_ids": whole == plan.token_ids}

    # prompts and their HF answers, all blobs stored before vLLM starts (and one after)
    p_stitched = HEAD + "".join(CHUNKS[:3]) + question("Who completed the Varnholt bridge, and when?")
    p_deleted = HEAD + "".join(CHUNKS[1:4]) + question("When did the Aldine sink?")
    p_corrupt = HEAD + CHUNKS[3] + CHUNKS[0] + question("Where does the Aldine's bell hang?")
    p_causal = HEAD + "".join(CHUNKS[2:]) + question("When is the market held?")
    ref = {"stitched": hf(p_stitched, CHUNKS[:3]), "deleted": hf(p_deleted, CHUNKS[1:4]),
           "corrupt": hf(p_corrupt, [CHUNKS[3], CHUNKS[0]])}
    # a lead blob: the first chunk after LEAD_HEAD, encoded right after it by an engine on the
    # same store that was told that head; the connector claims it for that chunk
    lead_engine = TurboRAGEngine(engine.loaded, store=engine.store, encoder=ENCODER,
                                 prompt_heads=[LEAD_HEAD], recovery="none")
    lead_engine.encode_chunks(CHUNKS[:3])
    p_lead = LEAD_HEAD + "".join(CHUNKS[:3]) + question("Who completed the Varnholt bridge, and when?")
    lead_turbo = lead_engine.generate(p_lead, chunks=CHUNKS[:3], config=config)
    lead_plan = plan_prompt(lead_engine.assembly.segments(p_lead, CHUNKS[:3])[0], engine.tokenizer)
    ref["lead"] = {"ids": lead_plan.token_ids, "turbo": lead_turbo.token_ids,
                   "reused": lead_turbo.stats.reused_tokens,
                   "hf_lead": bool(lead_turbo.stats.extra.get("lead_blob")),
                   "same_ids": engine.tokenizer(p_lead, add_special_tokens=False)["input_ids"]
                   == lead_plan.token_ids}
    # separators: chunks joined by "\n\n", as LlamaIndex joins them: both engines stitch the
    # separator between two chunks from its stored blob
    sep_chunks = SEPARATED
    engine.encode_chunks(sep_chunks)
    engine.library.encode_separators()  # as the connector does when it starts
    p_sep = HEAD + "\n\n".join(sep_chunks) + "\n\n" + question("Who discovered the comet, and when?")
    sep_segments, _, _ = engine.assembly.segments(p_sep, sep_chunks)
    sep_plan = plan_prompt(sep_segments, engine.tokenizer)
    ref["separated"] = {
        "ids": sep_plan.token_ids,
        "turbo": engine.generate(p_sep, chunks=sep_chunks, config=config).token_ids,
        "same_ids": engine.tokenizer(p_sep, add_special_tokens=False)["input_ids"]
        == sep_plan.token_ids,
        "separator_stored": all(engine.store.contains(k) for k in engine.library.encode_separators())
        and sum(s.cached and s.text == "\n\n" for s in sep_segments) == len(sep_chunks) - 1}
    # (i): the causal KV of a full prefill of all but the last token, as one plain blob
    causal_ids = engine.tokenizer(p_causal, add_special_tokens=False)["input_ids"]
    [causal_blob] = engine.library.prefix_encoder.encode_ids([causal_ids[:-1]])
    engine.store.put(causal_blob, kind="prefix")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="TurboRAGConnector",
        kv_connector_module_path="turborag_integrations.vllm.connector",
        kv_role="kv_consumer", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": store, "encoder": ENCODER, "refresh_s": 0})
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_transfer_config=ktc,
              max_model_len=2048, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

    def run(ids, salt=None):
        prompt = {"prompt_token_ids": ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason == "stop" and tokens and tokens[-1] in engine.eos_ids:
            tokens.pop()  # vLLM returns the end-of-sequence token, the HF engine does not
        return {"tokens": tokens,
                "finish": out.outputs[0].finish_reason,
                "params": out.kv_transfer_params}

    r = ref["stitched"]
    results["stitched"] = {**run(r["ids"], "turborag"), "hf_turbo": r["turbo"],
                           "hf_reused": r["reused"], "same_ids": r["same_ids"]}
    le = ref["lead"]
    results["lead"] = {**run(le["ids"], "turborag"), "hf_turbo": le["turbo"],
                       "hf_reused": le["reused"], "hf_lead": le["hf_lead"],
                       "same_ids": le["same_ids"]}
    sp = ref["separated"]
    results["separated"] = {**run(sp["ids"], "turborag"), "hf_turbo": sp["turbo"],
                            "same_ids": sp["same_ids"], "separator_stored": sp["separator_stored"]}
    # tenants: the chunks ingested into tenant acme's namespace only; the same prompt as acme,
    # as globex (whose namespace holds none of them), and with the default namespace's salt
    engine.namespaced("acme").encode_chunks(CHUNKS[:3])
    results["tenant_own"] = {**run(r["ids"], "turborag:acme"), "hf_turbo": r["turbo"],
                             "hf_reused": r["reused"]}
    results["tenant_other"] = {**run(r["ids"], "turborag:globex"), "hf_naive": r["naive"]}
    # a salt splits the heads, not the tenant's corpus: acme's chunks under acme's salt u1 (the
    # head encoded anew for it), and the default corpus under a per-user salt
    results["tenant_salted"] = {**run(r["ids"], "turborag:acme:u1"), "hf_turbo": r["turbo"],
                                "hf_reused": r["reused"],
                                "own_head": bool(engine.namespaced("acme/u1").store.keys())}
    results["default_salted"] = {**run(r["ids"], "turborag-user7"), "hf_turbo": r["turbo"],
                                 "hf_reused": r["reused"]}
    # a tenant's chunks joined by separators: the stock separators, stored once in the default
    # namespace, serve every tenant
    engine.namespaced("acme").encode_chunks(sep_chunks)
    from turborag_integrations.core.prefill.separators import separator_ids

    acme = engine.namespaced("acme")
    results["tenant_separated"] = {
        **run(sp["ids"], "turborag:acme"), "hf_turbo": sp["turbo"],
        "separators_in_acme": sum(acme.store.contains(acme.store.key(acme.fingerprint, ids))
                                  for ids in separator_ids(engine.tokenizer))}
    # chunks named by the client: one stored (in the namespace of the request's salt), one
    # never ingested (ignored, and counted)
    engine.namespaced("/-named").encode_chunks(CHUNKS[:3])
    named = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, extra_args={"kv_transfer_params": {
        "turborag_chunks": [CHUNKS[0], "A chunk nobody ever ingested into this store."]}})
    out = llm.generate([{"prompt_token_ids": r["ids"], "cache_salt": "turborag-named"}], named,
                       use_tqdm=False)[0]
    results["named"] = {"tokens": list(out.outputs[0].token_ids),
                        "params": out.kv_transfer_params}
    # a recovery asked of vLLM: not claimed, prefilled whole (vLLM's causal answer), and told
    # why; "none" is the stitch as usual
    # (asked again with vLLM's skip_reading_prefix_cache, past the blocks the stitched
    # request above left in vLLM's own prefix cache under this salt)
    for name, spec, skip in (("select:0.15", "select:0.15", None),
                             ("select:0.15_skip", "select:0.15", True), ("none", "none", None)):
        asked = SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                               skip_reading_prefix_cache=skip, extra_args={
                                   "kv_transfer_params": {"turborag_recovery": spec}})
        out = llm.generate([{"prompt_token_ids": r["ids"], "cache_salt": "turborag"}], asked,
                           use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason == "stop" and tokens and tokens[-1] in engine.eos_ids:
            tokens.pop()
        results[f"recovery_{name}"] = {"tokens": tokens, "params": out.kv_transfer_params,
                                       "hf_naive": r["naive"], "hf_turbo": r["turbo"]}
    # (iii) the same tokens with no salt right after: vLLM's own causal answer
    results["plain_after"] = {**run(r["ids"]), "hf_naive": r["naive"]}
    results["causal"] = {**run(causal_ids, "turborag"), "plain": run(causal_ids)["tokens"],
                         "claimable": len(causal_ids) - 1}
    # (iv) a blob gone since it was indexed: the claim stops before it
    d = ref["deleted"]
    second = engine.library.chunk_key(CHUNKS[2])
    engine.store.delete(second)
    results["deleted"] = {**run(d["ids"], "turborag"), "hf_turbo": d["turbo"]}
    # (iv) a blob unreadable at load time (one the worker has not read yet): vLLM recomputes
    # its blocks
    c = ref["corrupt"]
    path = Path(engine.store.disk.path(engine.library.chunk_key(CHUNKS[3])))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    results["corrupt"] = {**run(c["ids"], "turborag"), "hf_turbo": c["turbo"]}
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1], sys.argv[2])
