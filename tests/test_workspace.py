"""The Workspace's ingestion: a file's chunks, in order, each encoded after those before."""

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
    enc = engine.encoder
    contexts = document_contexts(chunks, 16)
    assert contexts[2].endswith(chunks[0].strip() + "\n\n" + chunks[1].strip())
    for before, chunk in zip(contexts, chunks):
        ids = enc.tokenize(chunk)
        want = enc.encode_ids([ids], contexts=[enc.context_ids(before, len(ids))])[0]
        blob = engine.blob_for(chunk)
        assert blob.base_position == want.base_position
        assert blob.base_position > enc.base_position or before is None
        torch.testing.assert_close(blob.keys, want.keys, atol=1e-5, rtol=0)


def test_a_question_without_history_stitches_its_first_source_from_a_lead_blob(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False)
    docs = write_docs(tmp_path / "docs", {"harbour.md": "The harbour froze in 1903.",
                                          "mill.md": "The mill burned down in 1911."})
    workspace = Workspace(tmp_path / "ws", engine=engine)
    workspace.ingest([docs])
    assert len(engine.prompt_heads) == 1
    answer = workspace.ask("When did the harbour freeze?", k=2,
                           config=GenerationConfig(max_new_tokens=2))
    "".join(answer)
    assert answer.stats.extra["lead_blob"] is True and answer.stats.cache_hits == 2
    later = workspace.ask("And the mill?", k=2, config=GenerationConfig(max_new_tokens=2),
                          history=[{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}])
    "".join(later)
    assert "lead_blob" not in later.stats.extra  # another head: the usual blobs
