"""The engine on a CUDA device: exactness checks, TurboRAG TTFT, decode speed and RAPID's bound.

    python benchmarks/gpu.py --json                 # on a machine with a CUDA GPU
    python benchmarks/gpu.py --device cpu --quick   # the same script, small, as a dry run

Runs without any downloaded weights, so that it works on a machine with no model hub:

1. Exactness on the device (tiny random models, fp32, llama and qwen2): stitched logits against
   one forward under the independent-attention mask; the fast decode step against the stock
   forward; RAPID at η = 0 against the target's own greedy output; a KV-store round trip through
   the accelerator tier.
2. Speed with random weights in the real architectures (bf16): Qwen2.5-0.5B as the long-context
   target, Qwen2.5-0.5B (self-speculation) and Qwen2.5-1.5B (upward speculation) as drafters.
   Timings of these models do not depend on their weights, acceptance does: so RAPID is reported
   as its cost per round and the throughput that follows for a given acceptance, not as a
   measured answer-quality figure.
   - TTFT at --context-tokens: full prefill vs TurboRAG (512-token chunks from the KV store, with
     and without the accelerator tier);
   - decode tokens/s at that context: stock forward vs the engine's fast step;
   - RAPID: target step at the long context, drafter steps at the drafter's context, one
     (γ + 1)-token verification, hence speedup(α) = (accepted + 1) · t_target /
     (γ · t_draft + t_verify) with accepted = Σ_{i=1..γ} α^i (independent acceptances).
3. `TurboRAGLLM` in a stock LlamaIndex query engine on the device and on the CPU, the same
   Qwen2.5-0.5B-shaped model in bf16: the answers (equal?) and the TTFT of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import byte_tokenizer, tiny_model  # noqa: E402
from turborag_integrations.core.kv.cache import KVCache  # noqa: E402
from turborag_integrations.core.decode.fast import FastDecoder, stock_step  # noqa: E402
from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.settings import GenerationConfig  # noqa: E402
from turborag_integrations.core.models import LoadedModel  # noqa: E402
from turborag_integrations.core.rapid import RapidEngine, Side, target_greedy  # noqa: E402
from turborag_integrations.core.prefill.stitch import Segment  # noqa: E402
from turborag_integrations.core.prefill.stitch import plan_prompt, reference_forward  # noqa: E402
from turborag_integrations.core.store import KVStore  # noqa: E402

# Published architectures (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct).
QWEN = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps=3):
    """Median seconds of `fn()` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def to_device(loaded: LoadedModel, device) -> LoadedModel:
    loaded.model.to(device)
    return loaded


# ---- 1. exactness ------------------------------------------------------------------------------

def exactness(device, tmp: Path) -> dict:
    res = {}
    text = ("The lighthouse at Tall Widow Point is 38 meters high and was built in 1871. "
            "Its keeper, Odile, repairs clocks in the winter.")
    other = "The harbour archive holds maps of every reef between the two capes."
    for kind in ("llama", "qwen2"):
        loaded = to_device(tiny_model(kind, seed=1), device)
        engine = TurboRAGEngine(loaded, store=KVStore(tmp / f"kv-{kind}"), progress=False,
                                recovery="none")  # the stitch alone is what (a) compares
        # (a) stitched logits == one forward under the independent-attention mask
        segs = [Segment("<s>user\n"), Segment(text, engine.library.encoder.encode(text)),
                Segment(other, engine.library.encoder.encode(other)), Segment(" How high is it?\n")]
        plan = plan_prompt(segs, engine.tokenizer)
        pre = engine.prefill(segs, reserve=4)
        ref = reference_forward(loaded.model, plan, engine.library.encoder.anchor_ids)
        res[f"{kind}_stitched_max_abs_logit_diff"] = (
            pre.logits.float().cpu() - ref[-1].cpu()).abs().max().item()
        engine.cache_pool.release(pre.cache)
        # (b) fast decode step == stock forward
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        caches = []
        for _ in range(2):
            c = KVCache.empty(loaded.model, len(ids) + 8)
            with torch.inference_mode():
                loaded.model(input_ids=torch.tensor([ids], device=device), cache=c, use_cache=True)
            caches.append(c)
        fast = FastDecoder.for_model(loaded.model)
        diff = 0.0
        with torch.inference_mode():
            for i, tok in enumerate([5, 77, 130, 9]):
                x = stock_step(loaded.model, tok, len(ids) + i, caches[0])
                y = fast(tok, len(ids) + i, caches[1])
                diff = max(diff, (x.float() - y.float()).abs().max().item())
        res[f"{kind}_fast_step_max_abs_logit_diff"] = diff
        # several tokens in one pass (verification) == the same tokens one step at a time
        with torch.inference_mode():
            c1, c2 = caches
            c1.truncate(len(ids))
            c2.truncate(len(ids))
            steps = torch.stack([fast(t, len(ids) + i, c1) for i, t in enumerate([5, 77, 130])])
            together = fast.forward([5, 77, 130], len(ids), c2)
        res[f"{kind}_forward_vs_steps_max_abs_logit_diff"] = (
            steps.float() - together.float()).abs().max().item()
        # quantised drafting is CPU-only: on the device it falls back to plain decoding
        plain = engine.generate(text + " How high?", chunks=[text],
                                config=GenerationConfig(max_new_tokens=8))
        drafted = engine.generate(text + " How high?", chunks=[text],
                                  config=GenerationConfig(max_new_tokens=8, draft="bf16"))
        res[f"{kind}_draft_fallback_same_tokens"] = plain.token_ids == drafted.token_ids
        # (c) RAPID at eta = 0, greedy == the target's own greedy output
        rapid = RapidEngine(engine, gamma=4)
        context = " ".join([text, other] * 6)
        prefix, suffix = rapid.render(engine, context, "How high is the lighthouse?")
        want = target_greedy(engine, prefix, suffix, 24)
        got = rapid.generate(context, "How high is the lighthouse?", chunks=[text],
                             config=GenerationConfig(max_new_tokens=24))
        res[f"{kind}_rapid_eta0_equals_target_greedy"] = got.token_ids == want
        # (d) recovery modes and an int8 store run on the device
        prompt = "<s>user\n" + text + other + " How high is it?\n"
        for spec in ("boundary:4", "blend:0.2", "select:0.15", "select:auto"):
            out = engine.generate(prompt, chunks=[text, other], recovery=spec,
                                  config=GenerationConfig(max_new_tokens=4))
            res[f"{kind}_recovery_{spec}_tokens"] = len(out.token_ids)
        int8 = TurboRAGEngine(loaded, store=KVStore(tmp / f"kv8-{kind}", storage_dtype="int8"),
                              progress=False)
        out = int8.generate(prompt, chunks=[text, other], encode_missing=True,
                            config=GenerationConfig(max_new_tokens=4))
        res[f"{kind}_int8_store_tokens"] = len(out.token_ids)
    # (e) the accelerator tier of the KV store
    if device.type == "cuda":
        loaded = to_device(tiny_model("llama", seed=2), device)
        store = KVStore(tmp / "kv-acc", accelerator_bytes=64 << 20)
        engine = TurboRAGEngine(loaded, store=store, progress=False)
        key = engine.encode_chunks([text])[0]
        a = store.get(key, engine.fingerprint)
        b = store.get(key, engine.fingerprint)
        res["accelerator_tier_equal"] = bool(torch.equal(a.keys.cpu(), b.keys.cpu())
                                             and torch.equal(a.values.cpu(), b.values.cpu()))
        res["accelerator_tier_device"] = str(b.keys.device)
        res["store_stats"] = store.stats().as_dict()
    return res


# ---- 2. speed ----------------------------------------------------------------------------------

def random_model(arch: str, device, window: int, layers: int | None = None,
                 dtype: torch.dtype | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = byte_tokenizer()
    spec = dict(QWEN[arch])
    if layers:
        spec["num_hidden_layers"] = layers
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=max(window, 32768),
                         rope_theta=1e6, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    return LoadedModel(name=f"random-{arch}", model=model, tokenizer=tok, source="memory")


def words(n_bytes: int, seed: int) -> str:
    """Byte-tokenizer text of exactly n_bytes tokens (ASCII letters and spaces)."""
    g = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    idx = torch.randint(len(alphabet), (n_bytes,), generator=g).tolist()
    return "".join(alphabet[i] for i in idx)


def prefilled(model, n: int, device, extra: int = 64) -> tuple[KVCache, torch.Tensor]:
    cache = KVCache.empty(model, n + extra)
    ids = torch.randint(100, 200, (1, n), device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


def step_seconds(model, cache, start, device, fast: bool, steps: int) -> float:
    decoder = FastDecoder.for_model(model) if fast else None
    step = decoder if decoder is not None else (lambda t, p, c: stock_step(model, t, p, c))

    def run():
        with torch.inference_mode():
            for i in range(steps):
                logits = step(100 + i, start + i, cache)
                int(logits.argmax())  # a decode loop reads the token every step
        cache.truncate(start)
    return timed(run, device) / steps


def speed(device, context: int, chunk: int, gamma: int, drafter_tokens: int, tmp: Path,
          layers: int | None) -> dict:
    res = {"context_tokens": context, "chunk_tokens": chunk, "gamma": gamma,
           "drafter_tokens": drafter_tokens}
    target = random_model("qwen2.5-0.5b", device, context + 1024, layers)
    n_chunks = context // chunk
    chunks = [words(chunk, seed=i) for i in range(n_chunks)]
    question = " Which chunk mentions the keeper?\n"
    for acc_bytes, name in ((0, "host"), (8 << 30, "accelerator")):
        if name == "accelerator" and device.type != "cuda":
            continue
        store = KVStore(tmp / f"kv-speed-{name}", accelerator_bytes=acc_bytes,
                        memory_bytes=4 << 30)
        # the stitched prefill alone: the store tier's effect, not the recompute's
        engine = TurboRAGEngine(target, store=store, progress=False, batch_size=8,
                                recovery="none")
        t0 = time.perf_counter()
        engine.encode_chunks(chunks)
        sync(device)
        res[f"encode_s_{name}"] = time.perf_counter() - t0
        head = Segment("<s>user\n")
        segs_full = [Segment("<s>user\n" + "".join(chunks) + question)]

        def full():
            pre = engine.prefill(segs_full, reserve=4)
            int(pre.logits.argmax())
            engine.cache_pool.release(pre.cache)

        def turbo_from_store():
            # every call reads the blobs from the store, as a query does
            segs = [head] + [Segment(c, engine.library.blob_for(c)) for c in chunks] + [
                Segment(question)]
            pre = engine.prefill(segs, reserve=4)
            int(pre.logits.argmax())
            engine.cache_pool.release(pre.cache)

        if name == "host":
            res["ttft_full_s"] = timed(full, device)
        res[f"ttft_turbo_s_{name}"] = timed(turbo_from_store, device)
        res[f"ttft_speedup_{name}"] = res["ttft_full_s"] / res[f"ttft_turbo_s_{name}"]
    # decode at the long context: stock forward vs the fast step
    cache, _ = prefilled(target.model, context, device, extra=gamma + 80)
    steps = 32
    res["target_step_s_stock"] = step_seconds(target.model, cache, context, device, False, steps)
    res["target_step_s_fast"] = step_seconds(target.model, cache, context, device, True, steps)
    res["decode_tps_stock"] = 1 / res["target_step_s_stock"]
    res["decode_tps_fast"] = 1 / res["target_step_s_fast"]
    # one (γ + 1)-token verification at the long context (RAPID's split attention)
    side = Side(target.model, cache, None, context)

    def verify():
        side.feed([100] * (gamma + 1), keep=gamma + 1, verify=True)
        side.truncate(side.cache.length - (gamma + 1))
    res["verify_s"] = timed(verify, device)
    del cache, side
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # drafter steps at the drafter's context
    t_step = min(res["target_step_s_stock"], res["target_step_s_fast"])
    for arch in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        drafter = target if arch == "qwen2.5-0.5b" else random_model(arch, device, 8192, layers)
        dcache, _ = prefilled(drafter.model, drafter_tokens, device, extra=gamma + 80)
        t_draft = min(step_seconds(drafter.model, dcache, drafter_tokens, device, fast, steps)
                      for fast in (False, True))
        res[f"draft_step_s_{arch}"] = t_draft
        bound = {}
        for alpha in (0.4, 0.6, 0.8, 1.0):
            accepted = sum(alpha ** i for i in range(1, gamma + 1))
            bound[str(alpha)] = (accepted + 1) * t_step / (gamma * t_draft + res["verify_s"])
        res[f"rapid_speedup_at_acceptance_{arch}"] = bound
        del dcache
    return res


def llama_index_case(device, tmp: Path, layers: int | None) -> dict:
    """TurboRAGLLM in a stock LlamaIndex query engine on `device` and on the CPU: the same
    random-weight Qwen2.5-0.5B-shaped model in the same dtype (bf16), the same index (constant
    mock embeddings, so both retrieve the same nodes): answers, TTFT and reuse of each."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    from turborag_integrations.llama_index import TurboRAGLLM

    docs = Path(__file__).resolve().parents[1] / "turborag_integrations" / "data" / "sample_docs"
    index = VectorStoreIndex.from_documents(
        [Document(text=p.read_text(), metadata={"file": p.name}) for p in sorted(docs.glob("*.md"))],
        embed_model=MockEmbedding(embed_dim=8))
    out = {}
    for where in (device, torch.device("cpu")):
        loaded = random_model("qwen2.5-0.5b", where, 4096, layers, dtype=torch.bfloat16)
        engine = TurboRAGEngine(loaded, store=tmp / f"kv-li-{where.type}", progress=False)
        llm = TurboRAGLLM(engine, max_new_tokens=16)
        engine_qe = index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()],
                                          similarity_top_k=4)
        engine_qe.query("How high is the Tall Widow lighthouse?")  # encodes the blobs, warms up
        ttfts = []
        for _ in range(3):
            text = str(engine_qe.query("How high is the Tall Widow lighthouse?"))
            ttfts.append(llm.last_result.stats.ttft_s)
        stats = llm.last_result.stats
        out[where.type] = {"answer_ids": list(llm.last_result.token_ids), "text": text,
                           "ttft_median_s": statistics.median(ttfts),
                           "reused_tokens": stats.reused_tokens,
                           "prompt_tokens": stats.prompt_tokens}
        engine.close()
    out["same_answer"] = out[device.type]["answer_ids"] == out["cpu"]["answer_ids"]
    out["cpu_over_device_ttft"] = out["cpu"]["ttft_median_s"] / out[device.type]["ttft_median_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context-tokens", type=int, default=32768)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--drafter-tokens", type=int, default=4096)
    ap.add_argument("--gamma", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (2-layer models, 2K context): a dry run on the CPU")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # Nothing here can be measured without the device (TurboRAG, decode and RAPID alike):
        # say so and succeed, so that a CPU-only CI run of the script is not a failure.
        print(json.dumps({"skipped": "no CUDA device: nothing measured; --device cpu --quick "
                                     "runs the same script small, as a dry run"}, indent=2))
        return 0
    if args.quick:
        args.context_tokens, args.drafter_tokens = 2048, 512
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    import transformers
    result["transformers"] = transformers.__version__

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("exactness", lambda: exactness(device, Path(tmp))),
                         ("speed", lambda: speed(device, args.context_tokens, args.chunk_tokens,
                                                 args.gamma, args.drafter_tokens, Path(tmp),
                                                 2 if args.quick else None)),
                         ("llama_index", lambda: llama_index_case(device, Path(tmp),
                                                                  2 if args.quick else None))):
            t0 = time.perf_counter()
            try:
                result[name] = fn()
            except Exception:
                result[name] = {"error": traceback.format_exc()}
            result[name]["wall_s"] = time.perf_counter() - t0
            print(json.dumps({name: result[name]}, indent=2), file=sys.stderr, flush=True)
            save()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
