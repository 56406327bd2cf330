"""The Workspace's ingestion: a file's chunks, in order, each encoded after those before."""

import pytest
import torch

from tests.conftest import tiny_model, write_docs
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.context import document_contexts
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.workspace import Workspace


def test_a_files_chunks_are_encoded_after_the_chunks_before(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", context_tokens=16,
                            progress=False)
    text = " ".join(f"Line {i}: the harbour froze in {1900 + i}." for i in range(20))
    docs = write_docs(tmp_path / "docs", {"harbour.md": text})
    workspace = Workspace(tmp_path / "ws", chunk_tokens=48, engine=engine)
    workspace.ingest([docs])
    found = workspace.collection.get(include=["documents", "metadatas"])
    chunks = [d for _, d in sorted(zip((m["index"] for m in found["metadatas"]),
                                       found["documents"]))]
    assert len(chunks) > 2
    enc = engine.library.encoder
    contexts = document_contexts(chunks, 16)
    assert contexts[2].endswith(chunks[0].strip() + "\n\n" + chunks[1].strip())
    for before, chunk in zip(contexts, chunks):
        ids = enc.tokenize(chunk)
        want = enc.encode_ids([ids], contexts=[enc.context_ids(before, len(ids))])[0]
        blob = engine.library.blob_for(chunk)
        assert blob.base_position == want.base_position
        assert blob.base_position > enc.base_position or before is None
        torch.testing.assert_close(blob.keys, want.keys, atol=1e-5, rtol=0)


def test_a_question_without_history_stitches_its_first_source_from_a_lead_blob(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False)
    docs = write_docs(tmp_path / "docs", {"harbour.md": "The harbour froze in 1903.",
                                          "mill.md": "The mill burned down in 1911."})
    workspace = Workspace(tmp_path / "ws", engine=engine)
    workspace.ingest([docs])
    assert len(engine.library.prompt_heads) == 1
    answer = workspace.ask("When did the harbour freeze?", k=2,
                           config=GenerationConfig(max_new_tokens=2))
    "".join(answer)
    assert answer.stats.extra["lead_blob"] is True and answer.stats.cache_hits == 2
    later = workspace.ask("And the mill?", k=2, config=GenerationConfig(max_new_tokens=2),
                          history=[{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}])
    "".join(later)
    assert "lead_blob" not in later.stats.extra  # another head: the usual blobs


def long_text(n: int = 40) -> str:
    return " ".join(f"Line {i}: the harbour froze in {1900 + i}." for i in range(n))


def test_a_file_that_is_not_text_is_skipped_with_a_warning(tmp_path):
    """A binary file named notes.txt is not chunked (it would be noise, for minutes): it is
    counted, warned about and left out; the real document beside it is ingested."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False)
    docs = write_docs(tmp_path / "docs", {"harbour.md": "The harbour froze in 1903."})
    (docs / "notes.txt").write_bytes(bytes(range(256)) * 80)  # 20 KB, NUL bytes included
    (docs / "latin1.txt").write_bytes("café crème brûlée ".encode("latin-1") * 200)
    workspace = Workspace(tmp_path / "ws", engine=engine)
    with pytest.warns(UserWarning, match="notes.txt: binary content"):
        counts = workspace.ingest([docs])
    assert counts["unreadable"] == 2 and counts["ingested"] == 1
    sources = {m["source"] for m in workspace.collection.get(include=["metadatas"])["metadatas"]}
    assert sources == {str(docs / "harbour.md")}


def test_progress_moves_within_a_file_and_ends_at_every_byte(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False,
                            batch_size=2)
    docs = write_docs(tmp_path / "docs", {"a.md": long_text(), "b.md": "The mill burned."})
    total = sum(p.stat().st_size for p in docs.iterdir())
    seen = []
    counts = Workspace(tmp_path / "ws", chunk_tokens=32, engine=engine).ingest(
        [docs], progress=seen.append)
    assert counts["chunks"] > 4  # a.md alone takes several batches of 2
    done = [p.done_bytes for p in seen]
    assert done == sorted(done) and done[-1] == total and seen[-1].files_done == 2
    within_a = {p.done_bytes for p in seen if p.path.endswith("a.md") and p.files_done == 0}
    assert len(within_a - {0}) >= 2  # moved more than once before a.md was done


def test_an_interrupted_ingestion_keeps_its_blobs_and_resumes_where_it_stopped(tmp_path):
    """Each batch's blobs are stored as they are made: a run stopped in the middle of a file
    leaves them, and the rerun encodes only the rest (nothing half-written, nothing twice)."""
    from turborag_integrations.core.store.kvstore import KVStore

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False,
                            batch_size=2)
    docs = write_docs(tmp_path / "docs", {"a.md": long_text()})
    workspace = Workspace(tmp_path / "ws", chunk_tokens=32, engine=engine)

    def stop_after_two_batches(at):
        if at.done_bytes > 0 and len(stored) >= 4:
            raise KeyboardInterrupt

    stored = []
    original = KVStore.put

    def put(self, blob, *args, **kwargs):
        stored.append(blob.num_tokens)
        return original(self, blob, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVStore, "put", put)
        with pytest.raises(KeyboardInterrupt):
            workspace.ingest([docs], progress=stop_after_two_batches)
        first = len(stored)
        assert workspace.collection.count() == 0  # the file is not done: no chunk in Chroma
        stored.clear()
        counts = workspace.ingest([docs])
    assert counts["ingested"] == 1
    # the rerun stored only what the first run had not (lead blobs are made after all chunks)
    assert first >= 4 and len(stored) == 2 * counts["chunks"] - first
    assert workspace.collection.count() == counts["chunks"]
