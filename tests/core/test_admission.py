"""The hot set (core/admission.py): a chunk's blob made in the background on its k-th retrieval;
a request never waits for it and loses nothing while it is missing."""

import threading

import pytest
import torch

from turborag_integrations.core.admission import Admission, AdmissionConfig
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles."]
PROMPT = "Context:\n" + CHUNKS[0] + "\n" + CHUNKS[1] + "\nQ: where was Alice born?\nA:"
CONFIG = GenerationConfig(max_new_tokens=8)


def hot(tiny_llama, tmp_path, **settings) -> TurboRAGEngine:
    return TurboRAGEngine(tiny_llama, store=tmp_path / "kv", recovery="none", **settings)


def ask(engine):
    return engine.generate(PROMPT, chunks=CHUNKS, config=CONFIG)


def test_a_chunk_is_encoded_on_its_kth_retrieval_and_answers_are_exact_before(tiny_llama,
                                                                             tmp_path):
    engine = hot(tiny_llama, tmp_path, admit_after=2)
    assert not engine.encodes_at_ingestion
    naive = engine.generate(PROMPT, config=CONFIG, mode="naive")
    first = ask(engine)
    # no blob: every chunk is prefilled with the prompt, exactly as the full prefill does
    assert (first.stats.cache_hits, first.stats.cache_misses) == (0, 2)
    assert first.token_ids == naive.token_ids
    assert engine.admission.drain(30)
    assert engine.admission.stats.queued == 0  # one retrieval each: below admit_after
    second = ask(engine)
    assert second.stats.cache_misses == 2  # admitted now; encoded off the request path
    assert engine.admission.drain(30)
    assert (engine.admission.stats.queued, engine.admission.stats.encoded) == (2, 2)
    assert all(engine.store.contains(engine.library.chunk_key(c)) for c in CHUNKS)
    third = ask(engine)
    assert (third.stats.cache_hits, third.stats.cache_misses) == (2, 0)
    assert engine.admission.stats.queued == 2  # stored chunks are not queued again
    # the blob the hot set made is the one ingestion makes
    made = engine.library.blob_for(CHUNKS[0])
    with TurboRAGEngine(tiny_llama, store=tmp_path / "eager", recovery="none") as eager:
        eager.encode_chunks(CHUNKS[:1])
        torch.testing.assert_close(made.keys, eager.library.blob_for(CHUNKS[0]).keys)
    engine.close()


def test_a_request_never_waits_for_the_encoder(tiny_llama, tmp_path):
    engine = hot(tiny_llama, tmp_path, admit_after=1)
    started, release = threading.Event(), threading.Event()
    encode = engine.library.encode_chunks

    def slow(texts, **kw):
        started.set()
        release.wait(60)
        return encode(texts, **kw)

    engine.library.encode_chunks = slow
    try:
        ask(engine)  # admits both chunks
        assert started.wait(30)
        for _ in range(3):  # answered while the encoder is stuck on the first chunk
            assert ask(engine).stats.cache_misses == 2
        assert engine.admission.stats.queued == 2  # the pending ones are not queued twice
    finally:
        release.set()
    assert engine.admission.drain(30)
    assert ask(engine).stats.cache_hits == 2
    engine.close()


def test_a_failed_encode_is_counted_and_the_chunk_stays_prefilled(tiny_llama, tmp_path, caplog):
    engine = hot(tiny_llama, tmp_path, admit_after=1)

    def broken(texts, **kw):
        raise OSError("disk full")

    engine.library.encode_chunks = broken
    naive = engine.generate(PROMPT, config=CONFIG, mode="naive")
    assert ask(engine).token_ids == naive.token_ids
    assert engine.admission.drain(30)
    assert (engine.admission.stats.failed, engine.admission.stats.encoded) == (2, 0)
    assert "disk full" in caplog.text
    assert engine.store.stats().writes == 0
    del engine.library.encode_chunks  # the disk has room again: the next retrieval admits
    assert ask(engine).token_ids == naive.token_ids
    assert engine.admission.drain(30)
    assert engine.admission.stats.encoded == 2
    engine.close()


def test_a_full_queue_drops_admissions_instead_of_blocking(tiny_llama, tmp_path):
    engine = hot(tiny_llama, tmp_path, admit_after=1, admission_queue=1)
    release = threading.Event()
    encode = engine.library.encode_chunks
    engine.library.encode_chunks = lambda texts, **kw: (release.wait(60), encode(texts, **kw))[1]
    try:
        engine.admission.saw(engine.library, [f"chunk {i}" for i in range(4)])  # returns at once
        stats = engine.admission.stats
        # one in the encoder at most, one in the queue: the rest dropped, counted
        assert stats.queued + stats.dropped == 4 and stats.dropped >= 2
    finally:
        release.set()
    assert engine.admission.drain(30)
    assert engine.admission.stats.encoded == engine.admission.stats.queued
    engine.close()


def test_counts_age_past_the_tracked_chunks(tiny_llama, tmp_path):
    engine = hot(tiny_llama, tmp_path, admit_after=3, admission_tracked=2)
    admission = engine.admission
    admission.saw(engine.library, ["one", "two"])
    admission.saw(engine.library, ["one", "two"])
    assert admission.stats.ageings == 0
    admission.saw(engine.library, ["three"])  # a third chunk: every count halved, zeros gone
    assert admission.stats.ageings == 1
    assert sorted(admission._counts.values()) == [1, 1]
    engine.close()


def test_ingestion_stores_no_blob_under_a_hot_set(tiny_llama, tmp_path):
    """The adapters ask `encodes_at_ingestion`: the LangChain vector store (over a real
    in-memory store) indexes the texts and encodes nothing."""
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from turborag_integrations.langchain import KVCachingVectorStore

    engine = hot(tiny_llama, tmp_path, admit_after=2)
    store = KVCachingVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=8)),
                                 engine=engine)
    store.add_texts(CHUNKS)
    assert engine.store.stats().writes == 0
    assert len(store.similarity_search("Alice", k=2)) == 2
    engine.close()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_admit_after_fails_before_the_model_loads(bad):
    with pytest.raises(ValueError, match="admit_after must be an integer ≥ 1"):
        TurboRAGEngine("no-such-model-is-loaded", admit_after=bad)


@pytest.mark.parametrize("name", ["admission_queue", "admission_tracked"])
def test_bounds_below_one_are_refused(name):
    with pytest.raises(ValueError, match=name):
        AdmissionConfig(admit_after=1, **{name: 0})


def test_off_by_default(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", recovery="none")
    assert engine.encodes_at_ingestion
    ask(engine)
    assert engine.admission.stats.retrievals == 0
    assert isinstance(engine.admission, Admission) and not engine.admission.enabled


def test_a_mostly_cold_prompt_is_prefilled_whole_and_a_warm_one_stitched(tiny_llama, tmp_path):
    """Where retrieved chunks have no blob and stitching the rest would cost more than a full
    prefill (core/prefill/cost.py), the engine prefills the prompt whole: the exact answer."""
    from turborag_integrations.core.prefill.cost import stitching_pays

    long = ["Alice was born in Paris in 1901 and moved to Lyon in 1920. " * 3,
            "Bob keeps three red bicycles in a shed behind the old mill. " * 3,
            "Carol teaches chemistry at the village school on Tuesdays. " * 3]
    prompt = "Context:\n" + "\n".join(long) + "\nQ: where was Alice born?\nA:"
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", recovery="select:0.15")
    naive = engine.generate(prompt, config=CONFIG, mode="naive")
    engine.encode_chunks(long[:1])  # one chunk of three has a blob
    cold = engine.generate(prompt, chunks=long, config=CONFIG)
    segments = engine.assembly.segments(prompt, long)[0]
    assert not stitching_pays(engine._plan(segments), engine.recovery)
    assert cold.stats.cache_misses == 2 and cold.stats.reused_tokens == 0
    assert "full_prefill" in cold.stats.extra
    assert cold.token_ids == naive.token_ids
    engine.encode_chunks(long)
    warm = engine.generate(prompt, chunks=long, config=CONFIG)
    assert warm.stats.cache_hits == 3 and warm.stats.reused_tokens > 0
    assert "full_prefill" not in warm.stats.extra


def test_the_encoder_starts_nothing_while_a_request_is_prefilled(tiny_llama, tmp_path):
    engine = hot(tiny_llama, tmp_path, admit_after=1)
    admission = engine.admission
    encoded = threading.Event()
    encode = engine.library.encode_chunks
    engine.library.encode_chunks = lambda texts, **kw: (encode(texts, **kw), encoded.set())[0]
    with admission.prefilling():
        admission.saw(engine.library, ["a chunk admitted during a prefill"])
        assert not encoded.wait(0.5)  # held while the prefill runs
        assert admission.stats.encoded == 0
    assert encoded.wait(30)  # and encoded once it is over
    assert admission.drain(30) and admission.stats.encoded == 1
    engine.close()


def test_the_counting_window_is_what_the_disk_budget_holds(tiny_llama, tmp_path):
    """By default the ageing window is sized, after the first encode, to the chunk blobs the
    disk budget holds (core/admission.py); an explicit `admission_tracked` stays."""
    from turborag_integrations.core import admission as admission_module
    from turborag_integrations.core.store import KVStore

    store = KVStore(tmp_path / "kv", memory_bytes=0, disk_bytes="64MB", prefix_bytes="4MB")
    engine = TurboRAGEngine(tiny_llama, store=store, recovery="none", admit_after=1)
    assert engine.admission.tracked == admission_module.UNSIZED_TRACKED
    ask(engine)
    assert engine.admission.drain(30)
    blob = engine.library.blob_for(CHUNKS[0])
    size = blob.keys.numel() * blob.keys.element_size() * 2
    assert engine.admission.tracked == max(admission_module.MIN_TRACKED,
                                           (64_000_000 - 4_000_000) // size)
    fixed = TurboRAGEngine(tiny_llama, store=tmp_path / "b", recovery="none", admit_after=1,
                           admission_tracked=50)
    fixed.generate(PROMPT, chunks=CHUNKS, config=CONFIG)
    assert fixed.admission.drain(30) and fixed.admission.tracked == 50
    engine.close()
    fixed.close()


def test_a_hot_set_never_encodes_on_the_request_path(tiny_llama, tmp_path):
    """`encode_missing=True` (the Workspace's `ask`) encodes a missing chunk before the prefill;
    under a hot set the request leaves it to the background encoder instead."""
    engine = hot(tiny_llama, tmp_path, admit_after=2)
    result = engine.generate(PROMPT, chunks=CHUNKS, config=CONFIG, encode_missing=True)
    assert result.stats.cache_misses == 2
    assert engine.admission.drain(30) and engine.store.stats().writes == 0
    engine.close()
