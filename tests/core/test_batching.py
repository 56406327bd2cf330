"""Batched decoding: a batched step equals each request's own step, and requests decoded
together through `BatchScheduler` get the answers they get alone."""

from __future__ import annotations

import threading

import pytest
import torch

from turborag_integrations.core.batching import BatchScheduler, RequestCancelled
from turborag_integrations.core.batch_worker import BatchWorker
from turborag_integrations.core.decode.batch import BatchedDecoder
from turborag_integrations.core.decode.fast import FastDecoder
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import ContextWindowError
from turborag_integrations.core.request import Request
from turborag_integrations.core.kv.arena import BatchArena
from turborag_integrations.core.kv.cache import KVCache
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.prompt_template import render_chat

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles.",
          "Carol sails to Oslo every June.", "The old mill grinds rye on Sundays."]
TEXTS = ["Hello there", "The lighthouse keeper said that it", "x",
         "Once upon a time, in a land far away"]


def prefilled(model, tokenizer, text: str, room: int = 32) -> tuple[KVCache, int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cache = KVCache.empty(model, len(ids) + room)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache, len(ids)


@pytest.mark.parametrize("matmul", ["gemm", "linear"])
def test_a_batch_of_one_is_the_fast_step(tiny, matmul):
    model, tok = tiny.model, tiny.tokenizer
    fast = FastDecoder.for_model(model, matmul=matmul)
    batched = BatchedDecoder(fast)
    (a, n), (b, _) = prefilled(model, tok, TEXTS[1]), prefilled(model, tok, TEXTS[1])
    with torch.inference_mode():
        for i, token in enumerate([5, 77, 130]):
            x = fast.step(token, n + i, a)
            y = batched.step([token], [n + i], [b])
            assert y.shape == (1, model.config.vocab_size)
            assert torch.equal(x, y[0])
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("matmul", ["gemm", "linear"])
def test_each_row_of_a_batch_is_its_own_step(tiny, matmul):
    """Four requests of different lengths at their own positions: each row's logits and each
    cache equal the request's solo run (up to the summation order of a B-row matmul)."""
    model, tok = tiny.model, tiny.tokenizer
    fast = FastDecoder.for_model(model, matmul=matmul)
    batched = BatchedDecoder.for_model(model, matmul=matmul)
    assert batched.fast is fast
    solo = [prefilled(model, tok, t) for t in TEXTS]
    together = [prefilled(model, tok, t) for t in TEXTS]
    tokens = [5, 77, 130, 9]
    with torch.inference_mode():
        for step in range(3):
            want = torch.stack([fast.step(tokens[i], n + step, cache)
                                for i, (cache, n) in enumerate(solo)])
            got = batched.step(tokens, [n + step for _, n in together],
                               [cache for cache, _ in together])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            tokens = want.argmax(-1).tolist()
    for (a, n), (b, _) in zip(solo, together):
        assert a.length == b.length == n + 3
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(la.values, lb.values, rtol=1e-5, atol=1e-5)


def test_a_batched_step_checks_its_arguments(tiny_llama):
    batched = BatchedDecoder.for_model(tiny_llama.model)
    with pytest.raises(ValueError, match="one of each"):
        batched.step([1, 2], [3], [None, None])
    with pytest.raises(ValueError, match="at least one"):
        batched.step([], [], [])


# ---- the scheduler ----------------------------------------------------------------------------

@pytest.fixture
def engine(tiny, tmp_path):
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")
    engine.encode_chunks(CHUNKS)
    return engine


def prompt(i: int) -> str:
    """Prompts of different lengths over two of the stored chunks."""
    return (f"Context:\n{CHUNKS[i % 4]}\n{CHUNKS[(i + 1) % 4]}\n"
            f"Question {i}: {'and why ' * i}?\nAnswer:")


def run_together(scheduler: BatchScheduler, jobs, consume=None) -> list:
    """Iterate one stream per job, each on its own thread; return their results (or errors)."""
    out: list = [None] * len(jobs)

    def client(i: int) -> None:
        text, config = jobs[i]
        stream = scheduler.submit(text, chunks=CHUNKS, config=config)
        try:
            if consume is not None and consume(i, stream):
                out[i] = stream.result
                return
            for _ in stream:
                pass
            out[i] = stream.result
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a client did not finish"
    return out


def hold_first_prefill(engine, monkeypatch, scheduler: BatchScheduler, others: int):
    """Keep the worker in the first prefill until `others` requests wait behind it, so that
    they are admitted together and decode in one batch."""
    prefill, seen = engine._prefill, []

    def held(*args, **kwargs):
        if not seen:
            seen.append(1)
            for _ in range(2000):
                if scheduler.waiting >= others:
                    break
                threading.Event().wait(0.005)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(engine, "_prefill", held)


def test_eight_requests_decoded_together_equal_their_solo_answers(engine, monkeypatch):
    jobs = [(prompt(i), GenerationConfig(max_new_tokens=6 + 5 * i)) for i in range(8)]
    solo = [engine.generate(text, chunks=CHUNKS, config=config) for text, config in jobs]
    sizes, step = [], BatchedDecoder.step
    monkeypatch.setattr(BatchedDecoder, "step",
                        lambda self, tokens, *a: (sizes.append(len(tokens)), step(self, tokens, *a))[1])
    with BatchScheduler(engine, max_batch=8) as scheduler:
        hold_first_prefill(engine, monkeypatch, scheduler, others=7)
        results = run_together(scheduler, jobs)
    for want, got in zip(solo, results):
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.stats.finish_reason == want.stats.finish_reason
        assert got.stats.prompt_tokens == want.stats.prompt_tokens
        assert got.stats.reused_tokens == want.stats.reused_tokens
        assert got.stats.cache_hits == want.stats.cache_hits == 2
    assert [len(r.token_ids) for r in results] == [6 + 5 * i for i in range(8)]
    # the seven requests admitted together joined the first one: all eight in one step, and
    # the batch shrank as they finished
    assert max(sizes) == 8 and sizes[-1] == 1
    assert (scheduler.steps, scheduler.rows) == (len(sizes), sum(sizes))
    assert all(1 <= r.stats.extra["mean_batch_size"] <= 8 for r in results)


def test_sampling_settings_are_per_request(engine, monkeypatch):
    configs = [GenerationConfig(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1),
               GenerationConfig(max_new_tokens=20),
               GenerationConfig(max_new_tokens=20, temperature=1.2, top_k=20, seed=2),
               GenerationConfig(max_new_tokens=20, temperature=0.5, seed=3),
               GenerationConfig(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=4)]
    jobs = [(prompt(i), config) for i, config in enumerate(configs)]
    solo = [engine.generate(text, chunks=CHUNKS, config=config).token_ids for text, config in jobs]
    assert solo[0] != solo[4]  # the seed matters
    with BatchScheduler(engine) as scheduler:
        hold_first_prefill(engine, monkeypatch, scheduler, others=4)
        results = run_together(scheduler, jobs)
    assert [r.token_ids for r in results] == solo


def test_a_closed_stream_leaves_the_batch_and_frees_its_row(engine, monkeypatch):
    jobs = [(prompt(i), GenerationConfig(max_new_tokens=40)) for i in range(4)]
    solo = [engine.generate(text, chunks=CHUNKS, config=config) for text, config in jobs]
    caches, released, left = [], [], []
    prefill, release, leave = engine._prefill, engine.cache_pool.release, BatchArena.leave

    def recording_prefill(*args, **kwargs):
        pre = prefill(*args, **kwargs)
        caches.append(pre.cache)
        return pre

    monkeypatch.setattr(engine, "_prefill", recording_prefill)
    monkeypatch.setattr(engine.cache_pool, "release",
                        lambda cache: (released.append(cache), release(cache)))
    monkeypatch.setattr(BatchArena, "leave",
                        lambda self, cache: (left.append(cache), leave(self, cache)))
    closed = {}

    def close_early(i, stream) -> bool:
        if i != 1:
            return False
        for n, _ in enumerate(stream):
            if n == 3:
                before = len(left)
                stream.close()
                closed["left"] = left[before:]  # its row is free before close returns
                return True
        raise AssertionError("the stream ended before it was closed")

    with BatchScheduler(engine) as scheduler:
        results = run_together(scheduler, jobs, consume=close_early)
        assert scheduler._worker.arena.in_use == 0
    assert len(closed["left"]) == 1
    cancelled = results[1]
    assert cancelled.stats.finish_reason == "cancelled"
    assert cancelled.token_ids == solo[1].token_ids[:len(cancelled.token_ids)]
    assert len(cancelled.token_ids) < 40
    for i in (0, 2, 3):
        assert results[i].token_ids == solo[i].token_ids
    # each prefill's cache went back to the pool once (at admission: its tokens moved into the
    # arena), and every row the requests took in the arena was freed once
    assert sorted(map(id, released)) == sorted(map(id, caches))
    assert len(left) == len(jobs) and len(set(map(id, left))) == len(jobs)


def test_a_failing_prefill_fails_only_its_own_stream(engine):
    too_long = "x" * (engine.context_window + 10)
    jobs = [(prompt(0), GenerationConfig(max_new_tokens=12)),
            (too_long, GenerationConfig(max_new_tokens=12)),
            (prompt(2), GenerationConfig(max_new_tokens=12))]
    solo = [engine.generate(jobs[i][0], chunks=CHUNKS, config=jobs[i][1]) for i in (0, 2)]
    with BatchScheduler(engine) as scheduler:
        results = run_together(scheduler, jobs)
        assert isinstance(results[1], ContextWindowError)
        assert [results[0].token_ids, results[2].token_ids] == [s.token_ids for s in solo]
        # the scheduler keeps serving
        again = scheduler.submit(prompt(3), chunks=CHUNKS, config=GenerationConfig(max_new_tokens=4))
        assert "".join(again) == again.result.text
        assert len(again.result.token_ids) == 4


def test_stop_strings_and_end_of_sequence_are_per_request(engine):
    config = GenerationConfig(max_new_tokens=30)
    plain = [engine.generate(prompt(i), chunks=CHUNKS, config=config).token_ids
             for i in range(8)]
    # an end-of-sequence token that one answer (a) contains and another (b) does not
    a, b, eos = next((a, b, t) for a in range(8) for b in range(8)
                     for t in plain[a][1:] if t not in plain[b])
    engine.eos_ids = engine.eos_ids | {eos}
    stop = engine.tokenizer.decode(plain[b], skip_special_tokens=True)[8:11]
    jobs = [(prompt(a), config),  # ends at the end-of-sequence token
            (prompt(b), config),  # runs to its length
            (prompt(b), GenerationConfig(max_new_tokens=30, stop=[stop]))]  # ends at `stop`
    solo = [engine.generate(text, chunks=CHUNKS, config=c) for text, c in jobs]
    with BatchScheduler(engine) as scheduler:
        results = run_together(scheduler, jobs)
    assert [r.text for r in results] == [s.text for s in solo]
    assert [r.token_ids for r in results] == [s.token_ids for s in solo]
    assert results[0].token_ids == plain[a][:plain[a].index(eos)]
    assert results[1].token_ids == plain[b]
    assert stop and len(results[2].token_ids) < 30
    assert [r.stats.finish_reason for r in results] == ["stop", "length", "stop"]


def test_drafted_requests_decode_alongside_the_batch(engine):
    jobs = [(prompt(0), GenerationConfig(max_new_tokens=16, draft="bf16")),
            (prompt(1), GenerationConfig(max_new_tokens=16)),
            (prompt(2), GenerationConfig(max_new_tokens=16, quantize="bf16"))]
    solo = [engine.generate(text, chunks=CHUNKS, config=config) for text, config in jobs]
    with BatchScheduler(engine) as scheduler:
        results = run_together(scheduler, jobs)
    assert [r.token_ids for r in results] == [s.token_ids for s in solo]
    assert results[0].stats.extra["draft_rounds"] > 0
    assert "mean_batch_size" not in results[0].stats.extra


def test_streams_start_on_first_iteration_and_a_closed_scheduler_refuses(engine):
    scheduler = BatchScheduler(engine)
    stream = scheduler.submit(prompt(0), chunks=CHUNKS, config=GenerationConfig(max_new_tokens=3))
    assert scheduler.waiting == scheduler.in_flight == 0  # nothing runs before iteration
    assert "".join(stream) == stream.result.text
    assert stream.result.stats.new_tokens == 3
    late = scheduler.submit(prompt(1), chunks=CHUNKS)
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(late))
    with pytest.raises(ValueError):
        BatchScheduler(engine, max_batch=0)


def test_calls_run_on_the_worker_between_rounds(engine, monkeypatch):
    """Encoding chunks through `call` while requests decode: on the worker's thread, in order,
    errors to their caller, and the answers in flight unchanged."""
    jobs = [(prompt(i), GenerationConfig(max_new_tokens=30)) for i in range(3)]
    solo = [engine.generate(text, chunks=CHUNKS, config=config) for text, config in jobs]
    new_chunks = ["Dora paints lighthouses in Brest.", "Emil repairs clocks on Fridays."]
    ran, futures = [], []

    def first_call(i, stream) -> bool:
        if i != 0:
            return False
        for n, _ in enumerate(stream):
            if n == 2:  # mid-answer: the others are in the batch too
                futures.append(scheduler.call(lambda: ran.append(
                    (threading.current_thread().name, scheduler.in_flight))))
                futures.append(scheduler.call(lambda: engine.encode_chunks(new_chunks)))
                futures.append(scheduler.call(lambda: 1 / 0))
                futures.append(scheduler.call(lambda: ran.append("after the error")))
        return True

    with BatchScheduler(engine, name="the-worker") as scheduler:
        results = run_together(scheduler, jobs, consume=first_call)
        keys = futures[1].result(timeout=60)
        with pytest.raises(ZeroDivisionError):
            futures[2].result(timeout=60)
        futures[3].result(timeout=60)
        assert scheduler.call(lambda: 42).result(timeout=60) == 42
    name, in_flight = ran[0]
    assert name == "the-worker" and in_flight >= 1 and ran[1] == "after the error"
    assert keys == [engine.library.chunk_key(c) for c in new_chunks]
    assert all(engine.store.contains(k) for k in keys)
    assert [r.token_ids for r in results] == [s.token_ids for s in solo]
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.call(lambda: None)


def test_a_call_cancelled_before_it_starts_does_not_run(engine):
    gate, ran = threading.Event(), []
    with BatchScheduler(engine) as scheduler:
        held = scheduler.call(gate.wait)  # the worker waits here
        later = scheduler.call(lambda: ran.append(1))
        assert later.cancel()
        gate.set()
        held.result(timeout=60)
        scheduler.call(lambda: None).result(timeout=60)
    assert later.cancelled() and ran == []


def test_a_withdrawn_request_is_never_prefilled_and_one_in_the_batch_leaves_it(engine,
                                                                               monkeypatch):
    prefills, prefill = [], engine._prefill
    monkeypatch.setattr(engine, "_prefill",
                        lambda *a, **k: (prefills.append(1), prefill(*a, **k))[1])
    config = GenerationConfig(max_new_tokens=200)
    alone = engine.generate(prompt(0), chunks=CHUNKS, config=config)
    prefills.clear()
    with BatchScheduler(engine, max_batch=1) as scheduler:
        leave, withdraw = threading.Event(), threading.Event()
        first = scheduler.submit(prompt(0), chunks=CHUNKS, config=config, cancelled=leave)
        deltas = iter(first)
        next(deltas)  # in the batch, alone: it holds the one place
        waiting = scheduler.submit(prompt(1), chunks=CHUNKS, config=config, cancelled=withdraw)
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(
            pytest.raises(RequestCancelled, next, iter(waiting))))
        thread.start()
        for _ in range(2000):
            if scheduler.waiting == 1:
                break
            threading.Event().wait(0.005)
        assert scheduler.waiting == 1
        withdraw.set()
        thread.join(60)
        assert outcome and waiting.result is None
        assert scheduler.waiting == 0 and len(prefills) == 1  # the second was never prefilled

        leave.set()  # the first leaves the batch at the next round, its stream still open
        for _ in deltas:  # it ends, as if the answer had: the one who withdrew it knows why
            pass
        tokens = first.result.token_ids
        assert 1 <= len(tokens) < 200 and tokens == alone.token_ids[:len(tokens)]
        for _ in range(200):  # the worker notes it gone just after handing over the end
            if scheduler.in_flight == 0:
                break
            threading.Event().wait(0.005)
        assert scheduler.in_flight == 0


@pytest.mark.real_model
def test_real_model_batched_answers_equal_solo_answers(smollm2, tmp_path):
    engine = TurboRAGEngine(smollm2, store=tmp_path / "kv", recovery="none")
    questions = ["Who was born in Paris?", "How many bicycles does Bob keep?",
                 "Where does Carol sail?", "When does the mill grind rye?",
                 "Summarise the context in one sentence.", "Which city is mentioned first?"]
    engine.encode_chunks(CHUNKS)
    prompts = [render_chat(engine.tokenizer, [{"role": "user", "content": "Context:\n" + "\n".join(CHUNKS)
                                    + f"\n\nQuestion: {q}"}]) for q in questions]
    config = GenerationConfig(max_new_tokens=24)
    solo = [engine.generate(p, chunks=CHUNKS, config=config).token_ids for p in prompts]
    with BatchScheduler(engine) as scheduler:
        results = run_together(scheduler, [(p, config) for p in prompts])
    assert [r.token_ids for r in results] == solo


def test_ignore_eos_decodes_past_end_of_sequence_alone_and_batched(engine):
    """ignore_eos is per request: the same prompt ends at an end-of-sequence token without it
    and decodes every max_new_tokens token with it, alone and in one batch with the other."""
    config = GenerationConfig(max_new_tokens=30)
    ignoring = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    full = engine.generate(prompt(2), chunks=CHUNKS, config=ignoring).token_ids
    assert len(full) == 30
    engine.eos_ids = engine.eos_ids | {full[len(full) // 2]}
    first_end = next(i for i, t in enumerate(full) if t in engine.eos_ids)
    ends = engine.generate(prompt(2), chunks=CHUNKS, config=config)
    runs_on = engine.generate(prompt(2), chunks=CHUNKS, config=ignoring)
    assert ends.token_ids == full[:first_end] and ends.stats.finish_reason == "stop"
    assert runs_on.token_ids == full and runs_on.stats.finish_reason == "length"
    with BatchScheduler(engine) as scheduler:
        results = run_together(scheduler, [(prompt(2), config), (prompt(2), ignoring)])
    assert [r.token_ids for r in results] == [ends.token_ids, runs_on.token_ids]
    assert [r.stats.finish_reason for r in results] == ["stop", "length"]


# ---- requests by id: outputs and abort ---------------------------------------------------------

class Outputs:
    """A request's `on_output`: keeps what the worker reports, and notes the last one."""

    def __init__(self):
        self.outputs, self.threads = [], set()
        self.done = threading.Event()

    def __call__(self, output) -> None:
        self.outputs.append(output)
        self.threads.add(threading.current_thread().name)
        if output.finished:
            self.done.set()

    def wait(self) -> "Outputs":
        assert self.done.wait(60), "the request never finished"
        return self

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def last(self):
        return self.outputs[-1]


def wait_for(condition, what: str) -> None:
    for _ in range(4000):
        if condition():
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_outputs_arrive_in_order_and_end_with_one_finished(engine):
    """Each request's token ids reach its callback on the worker's thread, in order: those of
    its answer alone, then one last output that says why it ended, its stats complete."""
    config = GenerationConfig(max_new_tokens=12)
    plain = [engine.generate(prompt(i), chunks=CHUNKS, config=config).token_ids
             for i in range(8)]
    # an end-of-sequence token that one answer (b) meets part-way and another (a) never
    a, b, eos = next((a, b, t) for a in range(8) for b in range(8)
                     for t in plain[b][1:] if t not in plain[a])
    engine.eos_ids = engine.eos_ids | {eos}
    jobs = {"a": (prompt(a), config), "b": (prompt(b), config)}
    solo = {i: engine.generate(text, chunks=CHUNKS, config=c).token_ids
            for i, (text, c) in jobs.items()}
    assert len(solo["a"]) == 12 and 1 <= len(solo["b"]) < 12
    got = {i: Outputs() for i in jobs}
    with BatchScheduler(engine, name="the-worker") as scheduler:
        for i, (text, c) in jobs.items():
            scheduler.add_request(i, Request(text, CHUNKS, c), on_output=got[i])
        for outputs in got.values():
            outputs.wait()
    for i, outputs in got.items():
        assert outputs.token_ids == solo[i]
        assert [o.request_id for o in outputs.outputs] == [i] * len(outputs.outputs)
        assert [o.finished for o in outputs.outputs] == [False] * (len(outputs.outputs) - 1) + [
            True]
        assert outputs.threads == {"the-worker"} and outputs.last.error is None
        assert {"queue_s", "mean_batch_size"} <= set(outputs.last.stats.extra)
        assert outputs.last.stats.cache_hits == 2
    assert got["a"].last.finish_reason == "length" and got["b"].last.finish_reason == "stop"


def test_a_request_is_answered_in_its_namespace(tiny, tmp_path):
    """The tenant travels in the Request: blobs only tenant "a" ingested are reused for its
    requests, and a request that may also read "a" (`shared`) finds them; others prefill them."""
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", recovery="none")
    engine.namespaced("a").encode_chunks(CHUNKS)
    config = GenerationConfig(max_new_tokens=3)
    asked = {"a": Request(prompt(1), CHUNKS, config, namespace="a"),
             "root": Request(prompt(1), CHUNKS, config),
             "b": Request(prompt(1), CHUNKS, config, namespace="b"),
             "b reading a": Request(prompt(1), CHUNKS, config, namespace="b", shared=("a",))}
    got = {name: Outputs() for name in asked}
    with BatchScheduler(engine) as scheduler:
        for name, request in asked.items():
            scheduler.add_request(name, request, on_output=got[name])
        hits = {name: outputs.wait().last.stats.cache_hits for name, outputs in got.items()}
    assert hits == {"a": 2, "root": 0, "b": 0, "b reading a": 2}
    assert got["a"].token_ids == got["b reading a"].token_ids == engine.namespaced("a").generate(
        prompt(1), chunks=CHUNKS, config=config).token_ids


def test_abort_by_id_frees_the_place_of_a_queued_and_of_a_running_request(engine, monkeypatch):
    prefills, prefill = [], engine._prefill
    monkeypatch.setattr(engine, "_prefill",
                        lambda *a, **k: (prefills.append(1), prefill(*a, **k))[1])
    config = GenerationConfig(max_new_tokens=200)
    alone = engine.generate(prompt(0), chunks=CHUNKS, config=config).token_ids
    prefills.clear()
    running, queued, after = Outputs(), Outputs(), Outputs()
    with BatchScheduler(engine, max_batch=1) as scheduler:
        scheduler.add_request("running", Request(prompt(0), CHUNKS, config), on_output=running)
        wait_for(lambda: running.outputs, "the first token")  # it holds the one place
        scheduler.add_request("queued", Request(prompt(1), CHUNKS, config), on_output=queued)
        with pytest.raises(ValueError, match="queued or running"):
            scheduler.add_request("queued", Request(prompt(2)), on_output=Outputs())
        wait_for(lambda: scheduler.waiting == 1, "the second request to queue")

        assert scheduler.abort("queued")
        queued.wait()
        (only,) = queued.outputs  # never prefilled: no token, one last output
        assert only.finished and only.finish_reason == "cancelled"
        assert isinstance(only.error, RequestCancelled) and only.token_ids == []
        assert scheduler.waiting == 0 and len(prefills) == 1

        assert scheduler.abort("running")
        running.wait()
        assert running.last.finish_reason == "cancelled" and running.last.error is None
        tokens = running.token_ids
        assert 1 <= len(tokens) < 200 and tokens == alone[:len(tokens)]
        assert scheduler.in_flight == 0 and scheduler._worker.arena.in_use == 0  # its row is free
        assert not scheduler.abort("running") and not scheduler.abort("never added")

        # the place is free: the next request runs at once, under an id used before
        scheduler.add_request("queued",
                              Request(prompt(2), CHUNKS, GenerationConfig(max_new_tokens=4)),
                              on_output=after)
        after.wait()
        assert len(after.token_ids) == 4 and after.last.finish_reason == "length"


def test_errors_reach_on_output_and_the_scheduler_goes_on(engine, monkeypatch):
    too_long = "x" * (engine.context_window + 10)
    config = GenerationConfig(max_new_tokens=30)
    with BatchScheduler(engine) as scheduler:
        failed = Outputs()
        scheduler.add_request("too long", Request(too_long, config=config), on_output=failed)
        (only,) = failed.wait().outputs
        assert isinstance(only.error, ContextWindowError) and only.finish_reason == "error"

        step, steps = BatchedDecoder.step, []

        def breaks(self, *args):
            steps.append(1)
            if len(steps) == 3:
                raise RuntimeError("the step broke")
            return step(self, *args)

        monkeypatch.setattr(BatchedDecoder, "step", breaks)
        broken = Outputs()
        scheduler.add_request("mid-answer", Request(prompt(0), CHUNKS, config), on_output=broken)
        broken.wait()
        assert len(broken.token_ids) == 3  # the prefill's token and two steps'
        assert broken.last.finish_reason == "error" and "broke" in str(broken.last.error)

        monkeypatch.setattr(BatchedDecoder, "step", step)
        calls = []

        def raising(output) -> None:  # a consumer's bug loses its own request only
            calls.append(output)
            raise ValueError("the consumer broke")

        scheduler.add_request("bad consumer", Request(prompt(1), CHUNKS, config),
                              on_output=raising)
        fine = Outputs()
        scheduler.add_request("fine",
                              Request(prompt(2), CHUNKS, GenerationConfig(max_new_tokens=5)),
                              on_output=fine)
        assert len(fine.wait().token_ids) == 5
        wait_for(lambda: calls and calls[-1].finished, "the bad consumer's request to end")
        assert calls[-1].finish_reason == "cancelled" and len(calls) == 2
        assert scheduler.in_flight == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_ends_every_request_it_holds(engine, monkeypatch):
    def dies(self, request):
        raise SystemExit("a bug that escapes the round")

    monkeypatch.setattr(BatchWorker, "_admit", dies)
    outputs = Outputs()
    scheduler = BatchScheduler(engine)
    scheduler.add_request("a", Request(prompt(0), CHUNKS), on_output=outputs)
    outputs.wait()
    assert outputs.last.finish_reason == "error" and "stopped" in str(outputs.last.error)
    stream = scheduler.submit(prompt(1), chunks=CHUNKS)
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(stream))


# ---- the arena: the batch's caches as rows of one storage --------------------------------------

def arena_of(model, tok, texts, room: int = 8) -> tuple[BatchArena, list, list[int]]:
    arena = BatchArena.for_model(model, rows=len(texts))
    rows, lengths = [], []
    for text in texts:
        cache, n = prefilled(model, tok, text)
        rows.append(arena.join(cache, room=room))
        lengths.append(n)
    return arena, rows, lengths


def test_joining_the_arena_copies_the_cache_and_leaving_keeps_rows_packed(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    plain = [prefilled(model, tok, t)[0] for t in TEXTS]
    arena, rows, _ = arena_of(model, tok, TEXTS)
    assert arena.in_use == 4 and [arena.row_of(c) for c in rows] == [0, 1, 2, 3]
    for want, got in zip(plain, rows):
        assert got.length == want.length
        for la, lb in zip(want.layers, got.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    arena.leave(rows[1])  # the last row moves into row 1
    assert arena.in_use == 3 and arena.row_of(rows[3]) == 1
    with pytest.raises(ValueError, match="not a row"):
        arena.row_of(rows[1])
    arena.leave(rows[3])
    arena.leave(rows[2])  # the last row in use: nothing moves
    assert [arena.row_of(c) for c in arena.caches] == [0]
    for i in (0,):
        for la, lb in zip(plain[i].layers, rows[i].layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    # growing past the capacity keeps every row's tokens
    before = [layer.keys.clone() for layer in rows[0].layers]
    arena.reserve(4 * arena.capacity)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, rows[0].layers))


def test_the_arena_refuses_what_it_cannot_hold(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    arena = BatchArena.for_model(model, rows=1)
    arena.join(prefilled(model, tok, TEXTS[0])[0])
    with pytest.raises(RuntimeError, match="all 1 rows"):
        arena.join(prefilled(model, tok, TEXTS[1])[0])
    other = BatchArena.for_model(model, rows=2)
    half = KVCache.empty(model, 8)
    half.storage.k, half.storage.v = half.storage.k.double(), half.storage.v.double()
    with pytest.raises(ValueError, match="layout"):
        other.join(half)


@pytest.mark.parametrize("batch_matmul", ["packed", "linear"])
def test_a_step_over_arena_rows_is_each_rows_own_step(tiny, batch_matmul):
    """Rows of one arena, of different lengths, passed in another order than their rows: each
    row's logits and keys equal the request's solo run, and the logits come back in the order
    the caches were given."""
    model, tok = tiny.model, tiny.tokenizer
    fast = FastDecoder.for_model(model)
    batched = BatchedDecoder.for_model(model, rows=4, batch_matmul=batch_matmul)
    assert (batched.packed is not None) == (batch_matmul == "packed")
    solo = [prefilled(model, tok, t) for t in TEXTS]
    arena, rows, lengths = arena_of(model, tok, TEXTS)
    order = [2, 0, 3, 1]
    tokens = [5, 77, 130, 9]
    calls = []
    attention = fast.attention
    with torch.inference_mode():
        for step in range(3):
            want = torch.stack([fast.step(tokens[i], lengths[i] + step, solo[i][0])
                                for i in range(4)])
            fast.attention = lambda *a, **k: (calls.append(a[4]), attention(*a, **k))[1]
            try:
                got = batched.step([tokens[i] for i in order],
                                   [lengths[i] + step for i in order], [rows[i] for i in order])
            finally:
                fast.attention = attention
            torch.testing.assert_close(got, want[order], rtol=1e-5, atol=1e-5)
            assert got.argmax(-1).tolist() == want[order].argmax(-1).tolist()
            tokens = want.argmax(-1).tolist()
    # one masked call per layer and step, not one per request
    assert len(calls) == 3 * model.config.num_hidden_layers
    assert all(mask is not None and mask.shape[0] == 4 for mask in calls)
    for (a, n), b in zip(solo, rows):
        assert b.length == n + 3
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(la.values, lb.values, rtol=1e-5, atol=1e-5)


def test_a_batch_of_one_arena_row_is_the_fast_step(tiny):
    model, tok = tiny.model, tiny.tokenizer
    fast = FastDecoder.for_model(model)
    batched = BatchedDecoder.for_model(model, batch_matmul="packed")
    a, n = prefilled(model, tok, TEXTS[3])
    arena, (row,), _ = arena_of(model, tok, [TEXTS[3]])
    with torch.inference_mode():
        for i, token in enumerate([5, 77, 130]):
            assert torch.equal(fast.step(token, n + i, a), batched.step([token], [n + i], [row])[0])


def test_the_scheduler_decodes_its_batch_in_one_arena(engine, monkeypatch):
    """Requests admitted together decode as rows of the scheduler's arena (one attention call
    per layer), and leave it empty."""
    jobs = [(prompt(i), GenerationConfig(max_new_tokens=5 + i)) for i in range(4)]
    solo = [engine.generate(text, chunks=CHUNKS, config=config) for text, config in jobs]
    spans = []
    attend_arena = BatchedDecoder._attend_arena
    monkeypatch.setattr(BatchedDecoder, "_attend_arena",
                        lambda self, arena: (spans.append(arena.in_use), attend_arena(self, arena))[1])
    with BatchScheduler(engine, max_batch=4) as scheduler:
        hold_first_prefill(engine, monkeypatch, scheduler, others=3)
        results = run_together(scheduler, jobs)
        assert scheduler._worker.arena.in_use == 0
    assert [r.token_ids for r in results] == [s.token_ids for s in solo]
    assert spans and max(spans) == 4
