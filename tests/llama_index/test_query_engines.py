"""The stock query and chat engines, unchanged, with TurboRAGLLM + KVCachePostprocessor."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import PromptTemplate
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.schema import MetadataMode

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.recovery import parse_recovery
from turborag_integrations.llama_index import (KVCachePostprocessor, KVCachingVectorStore,
                                               TurboRAGLLM, llm_text)

from .conftest import build_index, make_engine
from turborag_integrations.core.prompt_template import render_chat

QUESTION = "How high is the Tall Widow lighthouse?"
MODES = ["compact", "refine", "tree_summarize"]

# Context first, so the single retrieved chunk sits at position 0 of the prompt: there it sees
# only itself under full attention too, and the stitched answer must equal the full prefill's.
CONTEXT_FIRST = PromptTemplate("{context_str}\n\nQuestion: {query_str}\nAnswer:")


# Queries do not change the index: one per module keeps the suite fast.
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def index(engine, embed_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chroma")
    return build_index(KVCachingVectorStore(engine, path=folder), embed_model)


def plain_join(messages):
    return "\n".join(m.content for m in messages)


def answer(query_engine, question=QUESTION, streaming=False):
    response = query_engine.query(question)
    if streaming:
        return "".join(response.response_gen), response
    return str(response), response


def chunk_tokens(engine, nodes):
    return sum(len(engine.tokenizer(llm_text(n.node), add_special_tokens=False)["input_ids"])
               for n in nodes)


@pytest.mark.parametrize("streaming", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_stock_templates_reuse_the_retrieved_chunks(index, engine, llm_events, mode, streaming):
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine)],
                               similarity_top_k=2, response_mode=mode, streaming=streaming)
    text, response = answer(qe, streaming=streaming)
    stats = llm.last_stats
    assert text and stats["new_tokens"] > 0
    assert stats["cache_misses"] == 0 and stats["cache_hits"] >= 1
    # refine's last call holds one chunk; the others hold both
    expected = 1 if mode == "refine" else 2
    assert stats["cache_hits"] == expected
    assert stats["reused_tokens"] >= chunk_tokens(engine, response.source_nodes[-expected:])
    assert stats["prefilled_tokens"] == stats["prompt_tokens"] - stats["reused_tokens"]
    # the same stats travel on the LLM response itself (the last chunk when streaming)
    assert llm_events and llm_events[-1]["reused_tokens"] == stats["reused_tokens"]
    assert response.source_nodes[0].node.get_content(MetadataMode.LLM).startswith("source:")


@pytest.mark.parametrize("streaming", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_single_chunk_answer_equals_full_prefill(index, engine, mode, streaming):
    """One retrieved chunk right after the anchor's text: exact, token for token."""
    llm = TurboRAGLLM(engine, max_new_tokens=16,
                      messages_to_prompt=lambda ms: engine.anchor_text + plain_join(ms))
    naive = llm.baseline()
    answers = {}
    for name, model in (("turbo", llm), ("naive", naive)):
        qe = index.as_query_engine(llm=model, node_postprocessors=[llm.postprocessor()],
                                   similarity_top_k=1, response_mode=mode, streaming=streaming,
                                   text_qa_template=CONTEXT_FIRST, summary_template=CONTEXT_FIRST)
        text, response = answer(qe, streaming=streaming)
        answers[name] = (text, model.last_result)
    (turbo_text, turbo), (naive_text, full) = answers["turbo"], answers["naive"]
    assert turbo.stats.cache_hits == 1
    assert turbo.stats.reused_tokens >= chunk_tokens(engine, response.source_nodes)
    assert full.stats.reused_tokens == 0 and full.stats.mode == "naive"
    assert len(turbo.token_ids) > 0
    assert turbo.token_ids == full.token_ids
    assert turbo_text == naive_text


@pytest.mark.parametrize("streaming", [False, True], ids=["sync", "stream"])
def test_condense_plus_context_chat_engine(index, engine, streaming):
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    chat = CondensePlusContextChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=2), llm=llm,
        node_postprocessors=[llm.postprocessor()])
    for turn in (QUESTION, "And when was it first lit?"):  # the second turn also condenses
        if streaming:
            response = chat.stream_chat(turn)
            text = "".join(response.response_gen)
        else:
            response = chat.chat(turn)
            text = response.response
        assert text
        stats = llm.last_stats
        assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
        assert stats["reused_tokens"] >= chunk_tokens(engine, response.source_nodes)


def test_chat_engine_single_chunk_equals_full_prefill(index, engine):
    """A prompt that opens with the text chunks are encoded after (the engine's anchor), then
    the retrieved chunk: stitching is exact there, token for token."""
    llm = TurboRAGLLM(engine, max_new_tokens=16,
                      messages_to_prompt=lambda ms: engine.anchor_text + plain_join(ms))
    results = []
    for model in (llm, llm.baseline()):
        chat = CondensePlusContextChatEngine.from_defaults(
            retriever=index.as_retriever(similarity_top_k=1), llm=model,
            node_postprocessors=[llm.postprocessor()],
            context_prompt="{context_str}\n\nAnswer the user from the text above.")
        chat.chat(QUESTION)
        results.append(model.last_result)
    turbo, full = results
    assert turbo.stats.cache_hits == 1 and full.stats.reused_tokens == 0
    assert turbo.token_ids == full.token_ids and turbo.token_ids


def test_async_query_and_streaming(index, engine):
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    post = llm.postprocessor()

    async def run():
        qe = index.as_query_engine(llm=llm, node_postprocessors=[post], similarity_top_k=2)
        response = await qe.aquery(QUESTION)
        stats = dict(llm.last_stats)
        sqe = index.as_query_engine(llm=llm, node_postprocessors=[post], similarity_top_k=2,
                                    streaming=True)
        streamed = await sqe.aquery(QUESTION)
        pieces = [piece async for piece in streamed.async_response_gen()]
        chunks = [c async for c in await llm.astream_complete("Say hi")]
        return str(response), stats, "".join(pieces), chunks

    text, stats, streamed_text, chunks = asyncio.run(run())
    assert text and stats["cache_hits"] == 2
    assert streamed_text == text  # greedy: the same prompt gives the same answer
    assert chunks[-1].additional_kwargs["turborag"]["new_tokens"] == 6
    assert "".join(c.delta for c in chunks) == chunks[-1].text


def test_async_stream_closed_early_then_called_again(engine, monkeypatch):
    """A consumer that stops after the first delta: the generation is closed (its cache back
    in the pool), and the next call answers as a fresh one does."""
    opened = []
    open_stream = engine.stream

    def recording_stream(*args, **kwargs):
        opened.append(open_stream(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(engine, "stream", recording_stream)
    llm = TurboRAGLLM(engine, max_new_tokens=8)
    fresh = llm.complete("Say hi").text

    async def run():
        responses = await llm.astream_complete("Say hi")
        async for first in responses:
            break
        await responses.aclose()
        del responses
        for _ in range(500):  # the LLM's own stream is closed as the event loop gets to it
            if opened[1].result is not None:
                break
            await asyncio.sleep(0.01)
        again = [r async for r in await llm.astream_complete("Say hi")]
        return first, again

    first, again = asyncio.run(run())
    assert first.delta and fresh.startswith(first.delta)
    assert opened[1].result is not None
    assert "".join(r.delta for r in again) == again[-1].text == fresh


def test_iterate_in_thread_closes_the_iterator_before_returning():
    import threading

    from turborag_integrations.core.async_iter import iterate_in_thread

    release, closed = threading.Event(), threading.Event()

    def numbers():
        try:
            i = 0
            while True:
                yield i
                release.wait(5)  # hold the worker until the consumer has stopped reading
                i += 1
        finally:
            closed.set()

    async def run():
        items = iterate_in_thread(numbers)
        async for first in items:
            break
        release.set()
        await items.aclose()
        return first, closed.is_set()

    assert asyncio.run(run()) == (0, True)


def test_complete_and_chat_use_the_chat_template(engine):
    from llama_index.core.llms import ChatMessage

    llm = TurboRAGLLM(engine, max_new_tokens=4)
    assert llm.metadata.is_chat_model and llm.metadata.context_window == engine.context_window
    assert llm.metadata.num_output == 4 and llm.metadata.model_name == engine.loaded.name
    completion = llm.complete("hi")
    chat = llm.chat([ChatMessage(role="user", content="hi")])
    assert completion.text == chat.message.content
    assert chat.additional_kwargs["turborag"]["prompt_tokens"] == len(
        engine.tokenizer(render_chat(engine.tokenizer, [{"role": "user", "content": "hi"}]),
                         add_special_tokens=False)["input_ids"])
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="hi")]))
    assert streamed[-1].message.content == chat.message.content
    assert streamed[-1].additional_kwargs["turborag"]["cache_misses"] == 0


def test_recovery_in_a_stock_query_engine(index, engine):
    """`recovery` reaches the engine: recomputing every chunk token gives the full prefill's
    tokens in the stock compact template, and boundary:K recomputes K tokens of each chunk."""
    post = [KVCachePostprocessor(engine)]

    def run(llm):
        answer(index.as_query_engine(llm=llm, node_postprocessors=post, similarity_top_k=2))
        return llm.last_result

    full = run(TurboRAGLLM(engine, max_new_tokens=8, mode="naive"))
    stitched = run(TurboRAGLLM(engine, max_new_tokens=8, recovery="none"))
    everything = run(TurboRAGLLM(engine, max_new_tokens=8, recovery="boundary:100000"))
    four = run(TurboRAGLLM(engine, max_new_tokens=8, recovery="boundary:4"))
    assert stitched.stats.cache_hits == everything.stats.cache_hits == four.stats.cache_hits == 2
    assert everything.token_ids == full.token_ids
    # 4 tokens of each chunk, and of each stitched separator between them, move to the prefill
    # — but the first chunk's: it is the stock head's lead blob, exact already
    moved = stitched.stats.reused_tokens - four.stats.reused_tokens
    assert 4 <= moved <= 4 * 2
    assert four.stats.prefilled_tokens == stitched.stats.prefilled_tokens + moved
    assert four.stats.extra["recovery"] == str(parse_recovery("boundary:4"))
    # "first" moves exactly the prompt's first chunk, the best-scored node, to the prefill —
    # on an engine without the stock head; with it, that chunk is its lead blob, exact already,
    # and "first" is left out
    assert stitched.stats.extra["lead_blob"] is True
    llm = TurboRAGLLM(engine, max_new_tokens=8, recovery="first")
    run(llm)
    assert llm.last_result.stats.reused_tokens == stitched.stats.reused_tokens
    assert llm.last_result.stats.extra["recovery"] == "none"
    headless = TurboRAGEngine(engine.loaded, store=engine.store, progress=False, recovery="none")
    llm = TurboRAGLLM(headless, max_new_tokens=8, recovery="first", stock_head=False)
    _, response = answer(index.as_query_engine(
        llm=llm, node_postprocessors=[KVCachePostprocessor(headless)], similarity_top_k=2))
    assert llm.last_result.stats.cache_hits == 2
    moved = stitched.stats.reused_tokens - llm.last_result.stats.reused_tokens
    assert moved == chunk_tokens(engine, response.source_nodes[:1]) > 0


def test_bad_settings_are_refused(engine):
    with pytest.raises(ValueError, match="mode"):
        TurboRAGLLM(engine, mode="fast")
    with pytest.raises(ValueError, match="unknown recovery 'edges:3'"):
        TurboRAGLLM(engine, recovery="edges:3")
    with pytest.raises(TypeError, match="TurboRAGEngine"):
        KVCachePostprocessor(object())


def test_drafted_decoding_in_a_query_engine_gives_the_same_answer(index, engine):
    post = [KVCachePostprocessor(engine)]
    plain, _ = answer(index.as_query_engine(llm=TurboRAGLLM(engine, max_new_tokens=8),
                                            node_postprocessors=post))
    llm = TurboRAGLLM(engine, max_new_tokens=8, draft="bf16")
    drafted, _ = answer(index.as_query_engine(llm=llm, node_postprocessors=post))
    assert drafted == plain and len(plain) > 0
    assert llm.last_result.stats.extra["drafted_tokens"] > 0
    with pytest.raises(ValueError, match="draft must be one of"):
        TurboRAGLLM(engine, draft="int4").complete("hi")


def test_the_model_tokenizer_counts_for_llama_index_offline(index, engine, monkeypatch):
    """`Settings.tokenizer = llm.tokenize`: LlamaIndex's prompt packing counts the model's own
    tokens (not tiktoken's), without the network, and a stock query engine still answers."""
    import time

    import llama_index.core
    from llama_index.core import Settings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = TurboRAGLLM(engine, max_new_tokens=8)
    text = "The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora."
    started = time.perf_counter()
    ids = llm.tokenize(text)
    assert time.perf_counter() - started < 1.0
    assert ids == engine.tokenizer(text, add_special_tokens=False)["input_ids"] and ids
    # what `Settings.tokenizer = llm.tokenize` sets, put back after the test
    monkeypatch.setattr(llama_index.core, "global_tokenizer", llm.tokenize)
    assert Settings.tokenizer(text) == ids
    qe = index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()],
                               similarity_top_k=2)
    reply, _ = answer(qe)
    assert llm.last_result.stats.cache_hits >= 1 and llm.last_result.token_ids
