"""The connector's two sides alone, without vLLM: a tiny llama's checkpoint folder, a real store
and the HF engine's blobs; vLLM's requests, steps and attention layers are stood in for by the
few fields the sides read. The scheduler side claims a prompt's stored head and chunks, the
worker side writes them into a paged cache stand-in, and the save role reads them back off it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from turborag_integrations.core.prefill.rope import KeyRotator
from turborag_integrations.core.store import KVStore
from turborag_integrations.vllm.claim import ClaimedSpan
from turborag_integrations.vllm.config import ConnectorConfig
from turborag_integrations.vllm.ingest import IngestPlan, chunk_prompt, ingest_params
from turborag_integrations.vllm.metadata import (LoadRequest, SaveRequest,
                                                 TurboRAGConnectorMetadata)
from turborag_integrations.vllm.save_side import ChunkSaver
from turborag_integrations.vllm.scheduler_side import TurboRAGConnectorScheduler
from turborag_integrations.vllm.worker_side import TurboRAGConnectorWorker

CHUNKS = ["The Varnholt bridge was completed in 1911 by Mira Szabo.\n",
          "The ferry Aldine sank in 1932 with no loss of life.\n"]
BLOCK = 16


def scheduler(model_dir, store: str, **settings) -> TurboRAGConnectorScheduler:
    config = ConnectorConfig(store=store, encoder="none", refresh_s=0, **settings)
    return TurboRAGConnectorScheduler(config, config.open_store(memory_bytes=0), model=model_dir,
                                      dtype=torch.float32)


def request(ids, salt="turborag", req_id="r", params=None):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=ids, cache_salt=salt,
                           kv_transfer_params=params)


def step(req_id: str, blocks: list[int], computed: int = 0, scheduled: int = 0):
    """A scheduler step that starts request `req_id` with these blocks."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(blocks,),
                                            num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[]),
        num_scheduled_tokens={req_id: scheduled})


@pytest.fixture(scope="module")
def stored(model_dir, tmp_path_factory):
    """A store with the HF engine's blobs of CHUNKS, and a prompt: head, both chunks, question."""
    store = str(tmp_path_factory.mktemp("kv"))
    first = scheduler(model_dir, store)  # an empty store: it loads the model for the separators
    engine = first.setup.engine
    keys = engine.encode_chunks(CHUNKS)
    head = engine.tokenizer("Context:\n", add_special_tokens=False)["input_ids"]
    chunks = [engine.library.encoder.tokenize(text) for text in CHUNKS]
    question = engine.tokenizer("Question: when?", add_special_tokens=False)["input_ids"]
    return SimpleNamespace(store=store, engine=engine, keys=keys, head=head, chunks=chunks,
                           ids=head + chunks[0] + chunks[1] + question)


def test_a_salted_request_claims_the_head_and_chunks_and_the_worker_is_told_where(model_dir,
                                                                                stored):
    side = scheduler(model_dir, stored.store)
    assert not side.setup.loaded  # the separators are stored: no model in the scheduler
    claimed = len(stored.head) + len(stored.chunks[0]) + len(stored.chunks[1])
    assert side.get_num_new_matched_tokens(request(stored.ids), 0) == (claimed, False)
    meta = side.build_connector_meta(step("r", [4, 0, 7, 2, 9, 1, 3, 5, 6]))
    [load] = meta.loads
    assert (load.req_id, load.first_token, load.block_ids, load.namespaces) == (
        "r", 0, [4, 0, 7, 2, 9, 1, 3, 5, 6], ("", "*public"))
    head_key = KVStore(stored.store).key(side.prefix_fp, stored.head)
    assert load.spans == [ClaimedSpan(head_key, 0, len(stored.head), True),
                          ClaimedSpan(stored.keys[0], len(stored.head), len(stored.chunks[0]),
                                      False),
                          ClaimedSpan(stored.keys[1], len(stored.head) + len(stored.chunks[0]),
                                      len(stored.chunks[1]), False)]
    assert (meta.chunk_fp, meta.prefix_fp, meta.saves) == (side.chunk_fp, side.prefix_fp, [])
    assert side.request_finished(request(stored.ids), []) == (False, {"turborag": {
        "claimed_tokens": claimed, "chunk_tokens": claimed - len(stored.head), "spans": 3,
        "separators": 0, "lead_blob": False}})


def test_tokens_vllm_holds_already_are_not_claimed_again(model_dir, stored):
    side = scheduler(model_dir, stored.store)
    claimed = len(stored.head) + len(stored.chunks[0]) + len(stored.chunks[1])
    assert side.get_num_new_matched_tokens(request(stored.ids), BLOCK) == (claimed - BLOCK,
                                                                           False)
    [load] = side.build_connector_meta(step("r", list(range(9)), computed=BLOCK)).loads
    assert load.first_token == BLOCK
    side.update_state_after_alloc(request(stored.ids, req_id="q"), None, 0)
    assert side.get_num_new_matched_tokens(request(stored.ids, req_id="q"), 0)[0] == claimed
    side.update_state_after_alloc(request(stored.ids, req_id="q"), None, 0)  # vLLM took none
    assert side.build_connector_meta(step("q", list(range(9)))).loads == []


def test_only_requests_salted_with_the_configured_prefix_are_claimed(model_dir, stored):
    side = scheduler(model_dir, stored.store, salt_prefix="tenant", public=False)
    for salt in (None, "turborag", "other"):
        assert side.get_num_new_matched_tokens(request(stored.ids, salt), 0) == (0, False)
        assert side.request_finished(request(stored.ids, salt), []) == (False, None)
    # "tenant-a": a split of the default namespace, its chunks and a head of its own
    claimed, _ = side.get_num_new_matched_tokens(request(stored.ids, "tenant-a"), 0)
    assert claimed == len(stored.head) + len(stored.chunks[0]) + len(stored.chunks[1])
    [load] = side.build_connector_meta(step("r", list(range(9)))).loads
    assert load.namespaces == ("/-a", "")  # "public": false leaves the public namespace out


def test_an_ingestion_request_is_planned_sent_once_its_prompt_is_complete_and_answered(
        model_dir, stored):
    config = ConnectorConfig(store=stored.store, encoder="none", refresh_s=0)
    side = TurboRAGConnectorScheduler(config, config.open_store(memory_bytes=0), model=model_dir,
                                      dtype=torch.float32, ingests=True, kv_role="kv_both")
    text = "Harbour records show the bell hangs in the town hall.\n"
    ids = chunk_prompt(stored.engine.tokenizer, text)
    ingest = request(ids, None, "i", ingest_params())
    assert side.get_num_new_matched_tokens(ingest, 0) == (0, False)  # computed, never claimed
    assert side.build_connector_meta(step("i", [3], scheduled=BLOCK)).saves == []  # not yet
    cached = SimpleNamespace(req_ids=["i"], new_block_ids=[([8, 1],)], resumed_req_ids=set(),
                             num_computed_tokens=[BLOCK])
    meta = side.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached,
        num_scheduled_tokens={"i": len(ids) - BLOCK}))
    anchor = len(stored.engine.library.encoder.anchor_ids)
    plan = IngestPlan(tuple(stored.engine.library.encoder.tokenize(text)), anchor, "", None)
    assert meta.saves == [SaveRequest("i", plan, [3, 8, 1])] and meta.loads == []
    key = KVStore(stored.store).key(side.chunk_fp, plan.chunk_ids)
    # the worker stored nothing here: the answer says so
    assert side.request_finished(ingest, []) == (False, {"turborag": {"ingest": {
        "key": key, "tokens": len(plan.chunk_ids), "stored": False, "existing": False,
        "replaced": False, "error": "the worker did not store the blob (vLLM's log says why)"}}})
    stored_before = request(chunk_prompt(stored.engine.tokenizer, CHUNKS[0]), None, "j",
                            ingest_params())
    side.get_num_new_matched_tokens(stored_before, 0)
    assert side.request_finished(stored_before, []) == (False, {"turborag": {"ingest": {
        "key": stored.keys[0], "tokens": len(stored.chunks[0]), "stored": True,
        "existing": True, "replaced": False}}})


def test_a_scheduler_that_could_not_start_claims_nothing_and_refuses_ingestion(model_dir,
                                                                             stored):
    config = ConnectorConfig(store=stored.store, encoder="none")
    off = TurboRAGConnectorScheduler(config, None, model=model_dir, dtype=torch.float32,
                                     ingests=True, kv_role="kv_both",
                                     off_reason="its RoPE cannot be re-rotated")
    assert not off.enabled and off.setup is None
    assert off.get_num_new_matched_tokens(request(stored.ids), 0) == (0, False)
    ingest = request(stored.ids, None, "i", ingest_params())
    off.get_num_new_matched_tokens(ingest, 0)
    assert off.request_finished(ingest, []) == (False, {"turborag": {"ingest": {
        "error": "TurboRAG is off in this vLLM: its RoPE cannot be re-rotated"}}})
    consumer = scheduler(model_dir, stored.store)
    consumer.get_num_new_matched_tokens(ingest, 0)
    assert consumer.request_finished(ingest, []) == (False, {"turborag": {"ingest": {
        "error": "this vLLM's connector runs as 'kv_consumer': ingestion needs "
                 '"kv_role": "kv_both"'}}})


class Attention:
    """An attention layer as the worker reaches it: its paged cache, indexed by block first
    ([blocks, keys | values, block_size, heads, dim]), and the backend's cache write."""

    def __init__(self, blocks: int, heads: int, dim: int):
        self.kv_cache = torch.zeros(blocks, 2, BLOCK, heads, dim)
        self.num_kv_heads, self.head_size = heads, dim
        self.impl = self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        kv_cache[slots // BLOCK, 0, slots % BLOCK] = key
        kv_cache[slots // BLOCK, 1, slots % BLOCK] = value


def worker_for(model_dir, store, layers):
    hf_config = AutoConfig.from_pretrained(model_dir)
    return TurboRAGConnectorWorker(KVStore(store), KeyRotator.for_config(hf_config),
                                   block_size=BLOCK, layers=hf_config.num_hidden_layers,
                                   num_blocks=len(layers[0].kv_cache), ranks=(0, 1))


def attention_layers(model_dir, blocks: int = 12) -> list[Attention]:
    hf_config = AutoConfig.from_pretrained(model_dir)
    dim = hf_config.hidden_size // hf_config.num_attention_heads
    return [Attention(blocks, hf_config.num_key_value_heads, dim)
            for _ in range(hf_config.num_hidden_layers)]


def forward(layers):
    return SimpleNamespace(no_compile_layers={f"model.layers.{i}.self_attn.attn": layer
                                              for i, layer in enumerate(layers)})


def test_the_worker_writes_each_claimed_blob_into_its_slots_keys_re_rotated(model_dir, stored):
    side = scheduler(model_dir, stored.store)
    side.get_num_new_matched_tokens(request(stored.ids), BLOCK)  # vLLM holds the first block
    blocks = [4, 0, 7, 2, 9, 1, 3, 5, 6]
    meta = side.build_connector_meta(step("r", blocks, computed=BLOCK))
    layers = attention_layers(model_dir)
    worker = worker_for(model_dir, stored.store, layers)
    worker.start_load_kv(meta, forward(layers))
    rotator = KeyRotator.for_config(AutoConfig.from_pretrained(model_dir))
    slots = torch.tensor([b * BLOCK + t for b in blocks for t in range(BLOCK)])
    [load] = meta.loads
    for span in load.spans:
        fp = meta.prefix_fp if span.plain else meta.chunk_fp
        blob = KVStore(stored.store).get(span.key, fp)
        lo = max(span.start, BLOCK)
        at = slots[lo:span.start + span.length]
        for index, layer in enumerate(layers):
            keys = layer.kv_cache[at // BLOCK, 0, at % BLOCK].transpose(0, 1)
            values = layer.kv_cache[at // BLOCK, 1, at % BLOCK].transpose(0, 1)
            offset = 0 if span.plain else span.start - blob.base_position
            want = rotator.rotate(blob.keys[index].float(), offset)[:, lo - span.start:]
            assert torch.equal(values, blob.values[index][:, lo - span.start:])
            assert torch.equal(keys, want)
    # the block vLLM holds is left alone
    assert all(layer.kv_cache[blocks[0]].abs().sum() == 0 for layer in layers)
    # vLLM's statistics of this load (metrics.py): the head lies in the block vLLM held
    [figures] = worker.take_loads()
    assert len(stored.head) < BLOCK
    assert figures[:3] == (load.spans[-1].start + load.spans[-1].length - BLOCK, 2, 0)
    assert figures.seconds > 0
    assert worker.take_loads() == [] and worker.get_block_ids_with_load_errors() == set()


def test_a_blob_the_worker_cannot_find_is_reported_as_its_blocks(model_dir, stored):
    layers = attention_layers(model_dir)
    worker = worker_for(model_dir, stored.store, layers)
    engine = stored.engine
    missing = ClaimedSpan("0" * 40, 0, 2 * BLOCK + 3, False)
    meta = TurboRAGConnectorMetadata([LoadRequest("r", [missing], 0, [5, 8, 2, 7])],
                                     chunk_fp=engine.fingerprint,
                                     prefix_fp=engine.library.prefix_fingerprint)
    worker.start_load_kv(meta, forward(layers))
    assert worker.get_block_ids_with_load_errors() == {5, 8, 2}
    assert worker.get_block_ids_with_load_errors() == set()  # handed to vLLM once
    assert [figures[:3] for figures in worker.take_loads()] == [(0, 0, 1)]
    assert all(layer.kv_cache.abs().sum() == 0 for layer in layers)


def test_the_save_role_reads_a_chunk_back_off_the_cache_as_the_blob_it_was(model_dir, stored,
                                                                           tmp_path):
    """A chunk blob loaded where its ingestion prompt puts it (after the anchor, unrotated) and
    read back off the cache by the save role is stored as that same blob, under its key."""
    engine = stored.engine
    anchor = engine.library.encoder.anchor_ids
    blob = KVStore(stored.store).get(stored.keys[0], engine.fingerprint)
    assert blob.base_position == len(anchor) > 0
    blocks = [6, 2, 9, 4, 11, 0, 8, 3, 10, 1, 7, 5][:-(-(len(anchor) + blob.num_tokens) // BLOCK)]
    span = ClaimedSpan(stored.keys[0], len(anchor), blob.num_tokens, False)
    plan = IngestPlan(tuple(blob.token_ids.tolist()), len(anchor), "", "doc-1")
    meta = TurboRAGConnectorMetadata([LoadRequest("r", [span], len(anchor), blocks)],
                                     [SaveRequest("i", plan, blocks)],
                                     chunk_fp=engine.fingerprint,
                                     prefix_fp=engine.library.prefix_fingerprint)
    layers = attention_layers(model_dir)
    worker_for(model_dir, stored.store, layers).start_load_kv(meta, forward(layers))
    made = KVStore(tmp_path / "made")
    saver = ChunkSaver(made, block_size=BLOCK, layers=len(layers), num_blocks=12)
    for index, layer in enumerate(layers):
        saver.save_layer(meta, index, f"model.layers.{index}.self_attn.attn", layer,
                         layer.kv_cache)
    saver.store_blobs(meta, 0, 1)
    again = made.get(stored.keys[0], engine.fingerprint)
    assert again is not None and again.base_position == blob.base_position
    assert torch.equal(again.keys, blob.keys) and torch.equal(again.values, blob.values)
    assert made.disk.keys_of_doc("doc-1") == [stored.keys[0]]
