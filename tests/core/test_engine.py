"""The engine end to end on tiny models: generation, streaming, stop strings, stats, bad input."""

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import ContextWindowError, EmptyChunkError
from turborag_integrations.core.library import KeyCache
from turborag_integrations.core.decode.loop import TextDeltas, now
from turborag_integrations.core.decode.sampling import warp_logits
from turborag_integrations.core.run import RunProgress, RunStats
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.prompt_template import render_chat

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles."]


@pytest.fixture
def engine(tiny, tmp_path):
    return TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")


@pytest.mark.parametrize("anchor", ["none", "chat", "bos"])
def test_single_chunk_greedy_equals_full_prefill(tiny, tmp_path, anchor):
    """A chunk placed right after the text it was encoded after is exactly a full prefill: at
    the very start of the prompt without an anchor, right after the anchor text with one."""
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", anchor=anchor, recovery="none")
    engine.encode_chunks(CHUNKS[:1])
    prompt = engine.anchor_text + CHUNKS[0] + "\nQ: where?\nA:"
    config = GenerationConfig(max_new_tokens=24)
    turbo = engine.generate(prompt, chunks=CHUNKS[:1], config=config)
    naive = engine.generate(prompt, chunks=CHUNKS[:1], config=config, mode="naive")
    assert bool(engine.anchor_text) == (anchor != "none")
    # the anchor text is the prompt's head here: it is cached too (as a plain prefix blob)
    head = len(engine.tokenizer(engine.anchor_text, add_special_tokens=False)["input_ids"]) \
        if engine.anchor_text else 0
    assert turbo.stats.reused_tokens == head + len(CHUNKS[0].encode())  # byte tokenizer
    assert naive.stats.reused_tokens == 0
    assert turbo.token_ids == naive.token_ids
    assert len(turbo.token_ids) > 0


def test_generation_matches_transformers_generate(engine):
    """With nothing cached the loop is plain greedy decoding: same tokens as HF generate."""
    prompt = "Hello there, how are"
    ids = engine.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        hf = engine.model.generate(ids, max_new_tokens=16, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    ours = engine.generate(prompt, config=GenerationConfig(max_new_tokens=16), mode="naive")
    expected = hf[0, ids.shape[1]:].tolist()
    cut = next((i for i, t in enumerate(expected) if t in engine.eos_ids), len(expected))
    assert ours.token_ids == expected[:cut]


def test_stream_deltas_concatenate_to_text_and_stats_are_filled(engine):
    engine.encode_chunks(CHUNKS)
    prompt = "Context:\n" + CHUNKS[0] + "\n" + CHUNKS[1] + "\nQuestion: who?\nAnswer:"
    stream = engine.stream(prompt, chunks=CHUNKS, config=GenerationConfig(max_new_tokens=20))
    text = "".join(stream)
    result = stream.result
    assert text == result.text
    s = result.stats
    assert s.cache_hits == 2 and s.cache_misses == 0
    # the chunks, the "\n" between them (a stock separator) and the leading "Context:\n"
    # cached as a prefix
    assert s.reused_tokens == sum(len(c.encode()) for c in CHUNKS) + len("\nContext:\n")
    assert s.prefilled_tokens == s.prompt_tokens - s.reused_tokens
    assert 0 < s.ttft_s and s.new_tokens == len(result.token_ids)


def test_missing_blob_is_prefilled_and_counted(engine):
    prompt = CHUNKS[0] + "\nQ?"
    r = engine.generate(prompt, chunks=CHUNKS[:1], config=GenerationConfig(max_new_tokens=4))
    assert r.stats.cache_misses == 1 and r.stats.reused_tokens == 0
    r = engine.generate(prompt, chunks=CHUNKS[:1], config=GenerationConfig(max_new_tokens=4),
                        encode_missing=True)
    assert r.stats.cache_hits == 1 and r.stats.reused_tokens > 0


def test_stop_strings_cut_the_text_and_never_leak():
    class Chars:  # one character per token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    d = TextDeltas(Chars(), stop=["END"])
    out = "".join(d.push(ord(c)) for c in "abc EN") + d.flush()
    assert out == "abc EN"  # a partial stop string is released at the end
    d = TextDeltas(Chars(), stop=["END"])
    pieces = []
    for c in "abc ENDxyz":
        pieces.append(d.push(ord(c)))
        if d.stopped:
            break
    assert "".join(pieces) == "abc " and d.text == "abc " and d.stopped


def test_run_progress_times_the_run_and_ends_it_for_its_reason():
    class Chars:  # one character per token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    progress = RunProgress(RunStats(), Chars(), stop=["END"], limit=10, started=now() - 1.0)
    assert "".join(progress.push(ord(c)) for c in "ab E") == "ab "  # "E" may start "END"
    assert progress.natural_reason() == "stop"  # 4 of 10 tokens: an end-of-sequence token
    result = progress.finish("stop")
    assert progress.flush() == "E" and result.text == "ab E" and result.token_ids == [
        ord(c) for c in "ab E"]
    assert result.stats.ttft_s >= 1.0 and result.stats.new_tokens == 4
    assert result.stats.finish_reason == "stop" and result.stats.decode_s >= 0

    stopped = RunProgress(RunStats(), Chars(), stop=["END"], limit=4)
    assert "".join(stopped.push(ord(c)) for c in "xEND") == "x" and stopped.stopped
    assert stopped.push(ord("y")) == "" and stopped.flush() == ""  # nothing after the stop

    full = RunProgress(RunStats(), Chars(), limit=2)
    for c in "hi":
        full.push(ord(c))
    assert full.natural_reason() == "length"
    never = RunProgress(RunStats(), Chars(), started=now() - 0.5).finish("cancelled")
    assert never.stats.ttft_s >= 0.5 and never.stats.decode_s == 0.0 and never.text == ""


def test_engine_stop_string(engine):
    free = engine.generate("Hi", config=GenerationConfig(max_new_tokens=12), mode="naive")
    assert len(free.text) >= 4
    stop = free.text[2:4]
    cut = engine.generate("Hi", config=GenerationConfig(max_new_tokens=12, stop=[stop]),
                          mode="naive")
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.stats.finish_reason == "stop"


def test_sampling_is_seeded_and_respects_top_k(engine):
    cfg = GenerationConfig(max_new_tokens=10, temperature=1.0, top_k=5, seed=7)
    a = engine.generate("Once", config=cfg, mode="naive")
    b = engine.generate("Once", config=cfg, mode="naive")
    assert a.token_ids == b.token_ids
    logits = torch.randn(50)
    kept = torch.isfinite(warp_logits(logits, GenerationConfig(temperature=1.0, top_k=5)))
    assert kept.sum() == 5 and set(kept.nonzero().flatten().tolist()) == set(logits.topk(5).indices.tolist())
    probs = warp_logits(torch.tensor([3.0, 2.0, 1.0, 0.0]),
                        GenerationConfig(temperature=1.0, top_p=0.7)).softmax(-1)
    assert probs[2:].sum() == 0 and probs[:2].sum() == pytest.approx(1.0)


def test_empty_chunk_is_rejected(engine):
    with pytest.raises(EmptyChunkError, match="empty chunk"):
        engine.encode_chunks(["fine", "   "])


def test_prompt_over_window_is_refused(engine):
    with pytest.raises(ContextWindowError):
        engine.generate("x" * 3000)


def test_chat_template_render(engine):
    text = render_chat(engine.tokenizer, [{"role": "user", "content": "hi"}])
    assert text.endswith("assistant\n") and "hi" in text


def test_blobs_are_reused_across_engines_on_disk(tiny, tmp_path):
    first = TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")
    keys = first.encode_chunks(CHUNKS)
    second = TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")
    second.store.memory.clear()
    assert all(second.store.get(k, second.fingerprint) is not None for k in keys)
    assert second.store.stats().disk_hits == 2


def test_prefix_caching_is_exact(tiny, tmp_path):
    """The text before the first chunk sees only itself, so caching it changes nothing."""
    prompt = "System: be brief.\nContext:\n" + CHUNKS[0] + "\n" + CHUNKS[1] + "\nQ: who?\nA:"
    with_prefix = TurboRAGEngine(tiny, store=tmp_path / "a", recovery="none")
    without = TurboRAGEngine(tiny, store=tmp_path / "b", cache_prefix=False, recovery="none")
    for e in (with_prefix, without):
        e.encode_chunks(CHUNKS)
    a = with_prefix.prefill(with_prefix.assembly.segments(prompt, CHUNKS)[0])
    b = without.prefill(without.assembly.segments(prompt, CHUNKS)[0])
    assert a.plan.reused_tokens == b.plan.reused_tokens + len("System: be brief.\nContext:\n")
    assert a.plan.token_ids == b.plan.token_ids
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)


def test_stream_closed_early_still_reports_stats(engine):
    stream = engine.stream("Hello", config=GenerationConfig(max_new_tokens=30), mode="naive")
    it = iter(stream)
    next(it)
    it.close()
    assert stream.result is not None and stream.result.stats.finish_reason == "cancelled"
    assert stream.result.stats.new_tokens >= 1


def test_prompt_without_found_chunks_is_not_stored(engine):
    before = len(engine.store.keys())
    engine.generate("no chunk here at all", chunks=["absent chunk text"],
                    config=GenerationConfig(max_new_tokens=2))
    assert len(engine.store.keys()) == before


def test_engine_closes_the_store_it_opened_and_only_that(tiny, tmp_path):
    from turborag_integrations.core.store import KVStore, StoreClosedError

    with TurboRAGEngine(tiny, store=tmp_path / "own", recovery="none") as own:
        own.encode_chunks(["A chunk the engine's own store keeps."])
    with pytest.raises(StoreClosedError):
        own.store.keys()
    shared = KVStore(tmp_path / "shared")
    with TurboRAGEngine(tiny, store=shared, recovery="none") as borrower:
        borrower.encode_chunks(["A chunk in a store the caller owns."])
    assert len(shared.keys()) == 1  # still open
    shared.close()


def test_namespaces_reuse_only_their_own_blobs_and_the_shared_ones(tiny, tmp_path):
    """Invariant 10 in the engine: what one namespace ingested is never reused by another; a
    namespace named as shared is read, never written."""
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")
    a, b = engine.namespaced("a"), engine.namespaced("b", shared=("public",))
    public = engine.namespaced("public")
    assert engine.namespaced("a") is a and a.namespace == "a" and engine.namespace == ""
    a.encode_chunks(CHUNKS[:1])
    public.encode_chunks(CHUNKS[1:])
    prompt = "Context:\n" + CHUNKS[0] + "\n" + CHUNKS[1] + "\nQuestion: who?\nAnswer:"
    config = GenerationConfig(max_new_tokens=4)
    tokens = {name: len(engine.tokenizer(c, add_special_tokens=False)["input_ids"])
              for name, c in zip("01", CHUNKS)}
    for view, hits in ((a, 1), (b, 1), (engine, 0), (public, 1)):
        stats = view.generate(prompt, chunks=CHUNKS, config=config).stats
        assert stats.cache_hits == hits, view.namespace
    assert b.generate(prompt, chunks=CHUNKS, config=config).stats.reused_tokens >= tokens["1"]
    b.generate(prompt, chunks=CHUNKS, config=config, encode_missing=True)  # encodes CHUNKS[0]
    assert b.store.contains(b.library.chunk_key(CHUNKS[0])) and not b.store.contains(b.library.chunk_key(CHUNKS[1]))
    assert not public.store.contains(public.library.chunk_key(CHUNKS[0]))
    assert a.library.chunk_key(CHUNKS[0]) != b.library.chunk_key(CHUNKS[0]) != engine.library.chunk_key(CHUNKS[0])
    engine.close()


def test_a_prepared_request_is_what_generate_decodes(engine):
    """engine.start is the one prefill of every run path: its first logits give generate's first
    token, its stats are generate's prompt stats, and its limit is the window's room."""
    from turborag_integrations.core.request import Request

    engine.encode_chunks(CHUNKS)
    prompt = "Context:\n" + CHUNKS[0] + "\n" + CHUNKS[1] + "\nQuestion: who?\nAnswer:"
    config = GenerationConfig(max_new_tokens=12)
    prepared = engine.start(Request(prompt, tuple(CHUNKS), config))
    try:
        logits = prepared.prefill.logits
        first = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
    finally:
        engine.cache_pool.release(prepared.prefill.cache)
    result = engine.generate(prompt, chunks=CHUNKS, config=config)
    assert result.token_ids[0] == first
    for field in ("prompt_tokens", "reused_tokens", "prefilled_tokens", "cache_hits"):
        assert getattr(prepared.stats, field) == getattr(result.stats, field)
    assert prepared.stats.cache_hits == 2 and prepared.limit == 12
    big = GenerationConfig(max_new_tokens=10 ** 6)
    prepared = engine.start(Request(prompt, tuple(CHUNKS), big))
    engine.cache_pool.release(prepared.prefill.cache)
    assert prepared.limit == engine.context_window - prepared.position
    with pytest.raises(ValueError, match="mode"):
        Request(prompt, mode="fast")


def test_views_of_quiet_namespaces_are_let_go_and_share_one_key_cache(tiny, tmp_path,
                                                                       monkeypatch):
    """A server makes a view per cache salt: the engine keeps the most recent views only, and
    the chunk keys they remember live in one bounded cache."""
    monkeypatch.setattr(TurboRAGEngine, "MAX_VIEWS", 2)
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")
    engine.library._keys = KeyCache(max_entries=4)  # before the first view shares it
    first = engine.namespaced("acme/s0")
    key = first.encode_chunks(CHUNKS[:1])[0]
    for i in range(1, 4):
        view = engine.namespaced(f"acme/s{i}")
        assert view.library._keys is engine.library._keys
        view.library.chunk_key(CHUNKS[0])
        view.library.chunk_key(CHUNKS[1])
    assert len(engine.library._keys) == 4  # one bound over every namespace
    assert engine.namespaced("acme/s3") is view and len(engine._views) == 2
    again = engine.namespaced("acme/s0")
    assert again is not first and again.library.chunk_key(CHUNKS[0]) == key  # the same namespace
    prompt = "Context:\n" + CHUNKS[0] + "\nQuestion: who?\nAnswer:"
    config = GenerationConfig(max_new_tokens=3)
    for held in (first, again):  # the one let go still answers from its namespace's blobs
        assert held.generate(prompt, chunks=CHUNKS[:1], config=config).stats.cache_hits == 1
    assert engine.namespaced("acme/s1").library.chunk_key(CHUNKS[0]) != key
    engine.close()


def test_low_level_prefill_takes_a_parsed_recovery_only(engine):
    """A spec is parsed where a setting is made (a Request, the engine's QueryConfig); the
    low-level prefill, which no setting passes through, refuses a string and says what to pass."""
    engine.encode_chunks(CHUNKS[:1])
    segments = engine.assembly.segments("Q: " + CHUNKS[0] + "\nA:", CHUNKS[:1])[0]
    with pytest.raises(TypeError, match=r"parse_recovery\('first'\)"):
        engine.prefill(segments, recovery="first")
    from turborag_integrations.core.prefill.recovery import parse_recovery

    first = engine.prefill(segments, recovery=parse_recovery("first")).plan.reused_tokens
    none = engine.prefill(segments, recovery=parse_recovery("none")).plan.reused_tokens
    (chunk,) = [s for s in segments if s.blob is not None and s.text == CHUNKS[0]]
    assert none - first == chunk.blob.num_tokens  # the chunk recomputed, the cached head kept
