"""The capacity planner: its bytes are what ingestion then writes, its errors come before
anything is written, and `turborag store plan` prints it."""

import json
import random

import pytest
from typer.testing import CliRunner

from turborag_integrations.cli import app
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.planner import CorpusShape, calibrate, plan
from turborag_integrations.core.store import KVStore, StoreConfig

CHUNKS, TOKENS = 60, 40


def words(tokenizer, n: int, seed: int) -> str:
    """A text of exactly n tokens of the byte tokenizer (one character a token)."""
    rng = random.Random(seed)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == n
    return text


@pytest.mark.parametrize("storage_dtype", ["native", "int8"])
def test_the_planned_bytes_are_what_ingestion_writes(tiny_llama, tmp_path, storage_dtype):
    shape = CorpusShape(CHUNKS, TOKENS, heads=1, context_tokens=16)
    with TurboRAGEngine(tiny_llama, store=tmp_path / "calibration", context_tokens=16,
                        progress=False) as engine:
        report = plan(shape, calibrate(engine, shape, storage_dtype=storage_dtype),
                      StoreConfig(storage_dtype=storage_dtype), root=tmp_path)
    store = KVStore(tmp_path / "kv", storage_dtype=storage_dtype, memory_bytes=0)
    with TurboRAGEngine(tiny_llama, store=store, context_tokens=16, progress=False,
                        prompt_heads=("Context:\n",)) as engine:
        texts = [words(engine.tokenizer, TOKENS, i) for i in range(CHUNKS)]
        engine.encode_chunks(texts, contexts=[None] + texts[:-1])
        written = store.disk_usage()["bytes"]
    assert store.disk_usage()["blobs"] == report["blobs"] == 2 * CHUNKS
    # every chunk has the planned length: only the headers' encoding names differ (a lead blob
    # names its prompt head), by a few bytes a blob
    assert abs(written - report["corpus_bytes"]) <= 0.001 * written
    store.close()


def test_bad_shapes_are_refused_before_anything_loads(tmp_path):
    for fields, word in (({"chunks": 0}, "chunks"), ({"chunk_tokens": 0}, "chunk_tokens"),
                         ({"heads": -1}, "heads")):
        args = {"chunks": 1, "chunk_tokens": 1, **fields}
        with pytest.raises(ValueError, match=word):
            CorpusShape(**args)


def test_a_chunk_longer_than_the_window_is_refused(tiny_llama, tmp_path):
    with TurboRAGEngine(tiny_llama, store=tmp_path, progress=False) as engine:
        window = engine.context_window
        with pytest.raises(ValueError, match="exceed what the model's window leaves"):
            calibrate(engine, CorpusShape(1, window + 1))
        with pytest.raises(ValueError, match="storage_dtype 'int4'"):
            calibrate(engine, CorpusShape(1, 8), storage_dtype="int4")


def test_store_plan_command(tmp_path, monkeypatch):
    runner = CliRunner()
    missing = runner.invoke(app, ["store", "plan", "--chunks", "10", "--chunk-tokens", "20",
                                  "--model", str(tmp_path / "no-such-model")])
    assert missing.exit_code == 2 and "error:" in missing.output
    assert list(tmp_path.iterdir()) == []  # nothing written
    bad = runner.invoke(app, ["store", "plan", "--chunks", "10", "--chunk-tokens", "20",
                              "--storage-dtype", "int4"])
    assert bad.exit_code == 2 and "int4" in bad.output


@pytest.mark.real_model
def test_store_plan_command_on_the_bundled_model():
    done = CliRunner().invoke(app, ["store", "plan", "--chunks", "1000", "--chunk-tokens", "100",
                                    "--storage-dtype", "int8", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["blobs"] == 1000
    assert report["corpus_bytes"] == 1000 * report["calibration"]["blob_bytes"]
    assert report["encode_hours"] > 0
