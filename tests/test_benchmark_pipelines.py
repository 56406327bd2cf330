"""benchmarks/pipelines.py: the shared corpus (default) and the per-item corpora, on a tiny model
saved to disk, with the real MiniLM embeddings and embedded Chroma."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pipelines.py"

SHIP = "The ship Marisol has a blue hull and sails from Velmora every morning."
BAKERY = "The bakery on Quay Street sells fennel bread and opens at six."
OWL = "Cinder the owl lives in the hotel lobby and hoots at midnight."
KILN = "The Orbital Kiln Company fires ceramic tiles in a vacuum furnace."
FERRY = "The Velmora ferry stops running every January when the harbour freezes."
ITEMS = [
    {"id": "ship", "question": "What colour is the hull of the ship Marisol?",
     "answers": ["blue"], "chunks": [KILN, SHIP, FERRY], "gold": [1]},
    # The gold index points at the owl chunk on purpose: top-1 retrieval for a bakery question
    # finds the bakery chunk, so the gold is not retrieved.
    {"id": "bakery", "question": "What bread does the bakery on Quay Street sell?",
     "answers": ["fennel"], "chunks": [BAKERY, OWL, SHIP], "gold": [1]},
    {"id": "none", "question": "Who painted the lighthouse?", "answers": [],
     "unanswerable": True, "chunks": [FERRY, OWL]},
]
DISTINCT = [KILN, SHIP, FERRY, BAKERY, OWL]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_pipelines", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script()


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(it) + "\n" for it in ITEMS))
    return path


@pytest.fixture
def collections(bench, monkeypatch):
    """Each prepare call of either pipeline: (pipeline, collection, k, the collection's texts)."""
    seen = []
    for cls, texts in ((bench.LlamaIndexPipeline, lambda s: s.store.client.get()["documents"]),
                       (bench.LangChainPipeline, lambda s: s.store.vectorstore.get()["documents"])):
        original = cls.prepare

        def prepare(self, chunks, collection, k, progress=False, sources=None,
                    _original=original, _texts=texts):
            _original(self, chunks, collection, k, progress, sources)
            seen.append((self.name, collection, k, sorted(_texts(self))))
        monkeypatch.setattr(cls, "prepare", prepare)
    return seen


def run_json(bench, capsys, *args) -> dict:
    assert bench.main([str(a) for a in args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_shared_corpus_holds_each_distinct_chunk_once_and_retrieves_top_k(
        bench, data, model_dir, tmp_path, capsys, collections):
    out = tmp_path / "rows.jsonl"
    report = run_json(bench, capsys, data, "--model", model_dir, "--k", 1,
                      "--max-new-tokens", 2, "--json", "--out", out)
    assert report["corpus"] == "shared" and report["k"] == 1
    assert report["corpus_chunks"] == len(DISTINCT)
    # one ingestion per pipeline, before the items, into one collection of every distinct chunk
    assert [(p, c, k) for p, c, k, _ in collections] == [(p, "corpus", 1)
                                                         for p in bench.PIPELINES]
    for *_, texts in collections:
        assert texts == sorted(DISTINCT)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(ITEMS) * len(bench.PIPELINES) * 2
    assert not any("error" in r for r in rows)
    assert all(r["retrieved_chunks"] == 1 for r in rows)
    gold = {(r["id"], r["pipeline"], r["mode"]): r["gold_retrieved"] for r in rows}
    for pipeline in bench.PIPELINES:
        for mode in bench.MODES:
            assert gold[("ship", pipeline, mode)] is True
            assert gold[("bakery", pipeline, mode)] is False
            assert gold[("none", pipeline, mode)] is None
    for r in report["results"]:
        assert r["gold_n"] == 2 and r["gold_retrieved_pct"] == 50.0
        # agreement compares TurboRAG with the full prefill: none for the full prefill itself
        compared = r["mode"] == "turbo"
        assert (r["correct_agreement_pct"] is not None) == compared
        assert (r["same_reply_as_full_pct"] is not None) == compared


def test_limit_asks_fewer_items_but_the_corpus_is_the_whole_set(
        bench, data, model_dir, capsys, collections):
    report = run_json(bench, capsys, data, "--model", model_dir, "--limit", 1,
                      "--pipelines", "langchain", "--max-new-tokens", 2, "--json")
    assert report["items"] == 1 and report["k"] == bench.DEFAULT_K
    assert report["corpus_chunks"] == len(DISTINCT)
    assert [texts for *_, texts in collections] == [sorted(DISTINCT)]


def test_per_item_keeps_one_collection_per_item_and_retrieves_all_its_chunks(
        bench, data, model_dir, tmp_path, capsys, collections):
    out = tmp_path / "rows.jsonl"
    report = run_json(bench, capsys, data, "--model", model_dir, "--per-item",
                      "--pipelines", "langchain", "--max-new-tokens", 2, "--json", "--out", out)
    assert report["corpus"] == "per-item" and report["k"] is None
    assert report["corpus_chunks"] == sum(len(it["chunks"]) for it in ITEMS)
    assert [(c, k, texts) for _, c, k, texts in collections] == [
        (f"item{i:05d}", len(it["chunks"]), sorted(it["chunks"])) for i, it in enumerate(ITEMS)]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    size = {it["id"]: len(it["chunks"]) for it in ITEMS}
    assert all(r["retrieved_chunks"] == size[r["id"]] for r in rows)
    # every chunk of the item is retrieved, so its gold always is
    assert {r["id"]: r["gold_retrieved"] for r in rows} == {"ship": True, "bakery": True,
                                                            "none": None}


def test_out_keeps_the_replies_of_a_run_that_is_stopped(bench, data, model_dir, tmp_path,
                                                          monkeypatch):
    """--out is written reply by reply: a run that dies on its second item leaves the first's."""
    original = bench.LangChainPipeline.answer

    def answer(self, question, mode, recovery=None):
        if question == ITEMS[1]["question"]:
            raise KeyboardInterrupt  # a user stopping a long run
        return original(self, question, mode, recovery)
    monkeypatch.setattr(bench.LangChainPipeline, "answer", answer)
    out = tmp_path / "rows.jsonl"
    with pytest.raises(KeyboardInterrupt):
        bench.main([str(a) for a in (data, "--model", model_dir, "--pipelines", "langchain",
                                     "--max-new-tokens", 2, "--json", "--out", out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["mode"]) for r in rows] == [("ship", m) for m in bench.MODES]
    assert all("reply" in r for r in rows)


def test_store_keeps_the_blobs_and_a_second_run_encodes_nothing(bench, data, model_dir, tmp_path,
                                                                capsys, monkeypatch):
    """--store DIR: the first run encodes the corpus into DIR; a second run over the same set
    reads every blob from it (not one blob written) and answers byte for byte alike."""
    from turborag_integrations.core.store.kvstore import KVStore

    written = []
    original = KVStore.put

    def put(self, blob, *args, **kwargs):
        written.append(blob)
        return original(self, blob, *args, **kwargs)
    monkeypatch.setattr(KVStore, "put", put)
    store = tmp_path / "kv"
    runs = []
    for n in (1, 2):
        out = tmp_path / f"rows{n}.jsonl"
        report = run_json(bench, capsys, data, "--model", model_dir, "--pipelines", "langchain",
                          "--max-new-tokens", 3, "--json", "--out", out, "--store", store)
        assert report["store"] == str(store)
        runs.append(([json.loads(line) for line in out.read_text().splitlines()], len(written)))
        written.clear()
    (first, first_written), (second, second_written) = runs
    assert first_written >= len(DISTINCT) and second_written == 0
    assert [r["reply"] for r in second] == [r["reply"] for r in first]
    assert all(r["cache_hits"] > 0 for r in second if r["mode"] == "turbo")


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k must be ≥ 1"),
    (["--k", "-3"], "--k must be ≥ 1"),
    (["--per-item", "--k", "3"], "--per-item retrieves every chunk"),
    (["--recovery", "edges:3"], "--recovery: unknown recovery 'edges:3'"),
    (["--store", "kv", "--engine-arg", "store=kv2"], "--store DIR or --engine-arg store=DIR"),
])
def test_bad_k_is_refused_with_a_clear_message(bench, data, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        bench.main([str(data), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_shared_corpus_is_the_ordered_union_without_duplicates(bench):
    items = [{"chunks": it["chunks"]} for it in ITEMS]
    assert bench.shared_corpus(items) == DISTINCT


def test_an_items_chunks_are_one_documents_linked_pieces(bench, tmp_path):
    """Each chunk's document is its first item's; LlamaIndex links a document's nodes in order
    (so an engine with context_tokens encodes each after the one before)."""
    items = [{"id": it["id"], "chunks": it["chunks"]} for it in ITEMS]
    sources = bench.corpus_sources(items)
    assert sources == ["ship", "ship", "ship", "bakery", "bakery"]
    from tests.conftest import tiny_model
    from turborag_integrations.core.engine import TurboRAGEngine

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", context_tokens=8,
                            progress=False)
    runner = bench.LlamaIndexPipeline(engine, tmp_path, max_new_tokens=2)
    runner.prepare(DISTINCT, collection="corpus", k=2, sources=sources)
    nodes = {n.get_content(): n for n in runner.store.get_nodes()}
    assert nodes[SHIP].prev_node.node_id == nodes[KILN].node_id
    assert nodes[BAKERY].prev_node is None and nodes[OWL].prev_node is not None
    assert nodes[OWL].ref_doc_id == "bakery"
    base = engine.library.encoder.base_position
    assert engine.library.blob_for(KILN).base_position == base
    assert engine.library.blob_for(FERRY).base_position == base + 8


def test_summary_agreement_and_gold_shares(bench):
    def row(id_, mode, reply, correct, gold):
        return {"id": id_, "pipeline": "langchain", "mode": mode, "reply": reply,
                "correct": correct, "refusal": False, "unanswerable": False, "ttft_s": 0.1,
                "prompt_tokens": 10, "reused_tokens": 5, "retrieved_chunks": 6,
                "gold_retrieved": gold}

    rows = [row("a", "naive", "Blue.", True, True), row("a", "turbo", "It is blue", True, True),
            row("b", "naive", "fennel", True, False), row("b", "turbo", "rye", False, False),
            row("c", "naive", "no idea", False, None), row("c", "turbo", "No idea", False, None)]
    naive, turbo = bench.summarise(rows, ["langchain"])
    assert naive["correct_agreement_pct"] is None and naive["same_reply_as_full_pct"] is None
    for r in (naive, turbo):
        assert r["gold_n"] == 2 and r["gold_retrieved_pct"] == 50.0
        assert r["median_retrieved_chunks"] == 6
    for r in (turbo,):
        assert r["correct_agreement_pct"] == pytest.approx(200 / 3)  # a and c
        assert r["same_reply_as_full_pct"] == pytest.approx(100 / 3)  # c only
        assert r["gold_n"] == 2 and r["gold_retrieved_pct"] == 50.0
        assert r["median_retrieved_chunks"] == 6


def in_document_order(places) -> bool:
    """Each document's chunks together and in their order in it."""
    order = [tuple(p) for p in places]
    groups = list(dict.fromkeys(document for document, _ in order))
    return order == [p for g in groups for p in sorted(x for x in order if x[0] == g)]


def test_order_document_puts_both_modes_chunks_in_document_order(bench, data, model_dir,
                                                                tmp_path, capsys):
    rows = {}
    for order in ("score", "document"):
        out = tmp_path / f"{order}.jsonl"
        report = run_json(bench, capsys, data, "--model", model_dir, "--k", 3, "--order", order,
                          "--max-new-tokens", 2, "--json", "--out", out)
        assert report["order"] == order
        rows[order] = [json.loads(line) for line in out.read_text().splitlines()]
    # where each retrieved chunk comes from: (document, index in it), in prompt order
    ship = next(r for r in rows["score"] if r["id"] == "ship")
    assert ship["retrieved_from"][0] == ["ship", 1]  # the hull chunk ranks first
    assert not all(in_document_order(r["retrieved_from"]) for r in rows["score"])
    assert all(in_document_order(r["retrieved_from"]) for r in rows["document"])
    assert len(rows["document"]) == len(ITEMS) * len(bench.PIPELINES) * 2
    for a, b in zip(rows["score"], rows["document"]):  # the same chunks, only reordered
        assert sorted(map(tuple, a["retrieved_from"])) == sorted(map(tuple, b["retrieved_from"]))
