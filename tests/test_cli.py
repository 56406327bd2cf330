"""The `turborag` command line, end to end on a tiny model saved to disk (a local-folder model)."""

import json
import re

import pytest
from typer.testing import CliRunner

from turborag_integrations.cli import app
from tests.conftest import write_docs

runner = CliRunner()
DOCS = {
    "a.md": "# Ships\n\nThe ship Marisol has a blue hull and sails from Velmora every morning.",
    "b.txt": "The bakery on Quay Street sells fennel bread. It opens at six.",
    "c.html": "<html><body><h1>Owls</h1><p>Cinder the owl lives in the lobby.</p>"
              "<script>var x = 1;</script></body></html>",
}


@pytest.fixture
def docs(tmp_path):
    return write_docs(tmp_path / "docs", DOCS)


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def last_json(out: str) -> dict:
    # stderr progress bars share the captured output; the JSON object is the last "{...}"
    return json.loads([line[line.find('{"'):] for line in out.splitlines() if '{"' in line][-1])


def test_ingest_then_ask_reuses_blobs_and_reruns_skip(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    code, out = run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 64,
                    "--json")
    assert code == 0, out
    counts = last_json(out)
    assert counts["ingested"] == 3 and counts["chunks"] >= 3
    code, out = run("ingest", docs, "--store", ws, "--json")
    assert last_json(out)["skipped"] == 3
    code, out = run("ask", "Which ship has a blue hull?", "--store", ws, "--json",
                    "--max-new-tokens", 8, "--compare")
    assert code == 0, out
    report = last_json(out)
    assert report["reused_fraction"] > 0.5 and report["full_prefill_ttft_s"] > 0
    assert report["sources"] and all(s.endswith((".md", ".txt", ".html")) for s in report["sources"])


def test_ingest_with_context_tokens_keeps_them_for_the_workspace(tmp_path, model_dir):
    """--context-tokens on the first ingestion is the workspace's: recorded, and every chunk
    after a file's first is encoded after the text before it; a later run keeps it."""
    from turborag_integrations.workspace import Workspace

    long_doc = " ".join(f"Pier {i} of Velmora harbour was built in {1800 + i}." for i in range(30))
    docs = write_docs(tmp_path / "long", {"harbour.md": long_doc})
    ws = tmp_path / "ws"
    code, out = run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 48,
                    "--context-tokens", 12, "--json")
    assert code == 0, out
    assert json.loads((ws / "manifest.json").read_text())["context_tokens"] == 12
    workspace = Workspace(ws)
    assert workspace.context_tokens == 12
    engine = workspace.engine
    found = workspace.collection.get(include=["documents", "metadatas"])
    positions = sorted((m["index"], engine.library.blob_for(d).base_position)
                       for d, m in zip(found["documents"], found["metadatas"]))
    base = engine.library.encoder.base_position
    assert len(positions) > 2
    assert [p for _, p in positions] == [base] + [base + 12] * (len(positions) - 1)
    code, out = run("ingest", docs, "--store", ws, "--json")
    assert code == 0 and last_json(out)["skipped"] == 1


def test_changed_file_is_reingested(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 64)
    (docs / "b.txt").write_text("The bakery moved to Harbour Lane and now opens at seven.")
    code, out = run("ingest", docs, "--store", ws, "--json")
    counts = last_json(out)
    assert counts["ingested"] == 1 and counts["skipped"] == 2


def test_store_verify_finds_corruption(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 64)
    assert run("store", "verify", "--store", ws)[0] == 0
    blob = next((ws / "kv" / "blobs").rglob("*.safetensors"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    code, out = run("store", "verify", "--store", ws)
    assert code == 1 and "checksum" in out


def test_store_gc_shrinks_the_store_to_a_size(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 16)
    code, out = run("store", "stats", "--store", ws, "--json")
    before = last_json(out)
    assert code == 0 and before["blobs"] >= 4 and before["budget_bytes"] > before["bytes"]
    target = before["bytes"] // 2
    code, out = run("store", "gc", "--store", ws, "--max-bytes", f"{target / 1000:.3f}kB")
    assert code == 0, out
    assert "cold blob(s) evicted" in out
    after = last_json(run("store", "stats", "--store", ws, "--json")[1])
    assert 0 < after["bytes"] <= target and after["blobs"] < before["blobs"]
    code, out = run("store", "gc", "--store", ws, "--max-bytes", "lots")
    assert code == 2 and "not a size" in out


def test_clear_errors(tmp_path, docs, model_dir):
    code, out = run("ask", "anything", "--store", tmp_path / "empty", "--model", model_dir)
    assert code == 2 and "no documents yet" in out and "turborag ingest" in out
    assert not (tmp_path / "empty").exists()  # a question over nothing leaves nothing behind
    code, out = run("ask", "anything", "--store", tmp_path / "empty", "--draft", "int4")
    assert code == 2 and "draft must be one of" in out
    code, out = run("ingest", tmp_path / "missing", "--store", tmp_path / "ws")
    assert code == 2 and "no such file or folder" in out
    code, out = run("ingest", docs, "--store", tmp_path / "ws2", "--model", "no-such-model")
    assert code == 2 and "unknown model" in out
    code, out = run("models", "prepare", "nope")
    assert code == 2 and "unknown bundled model" in out


def test_models_list():
    code, out = run("models", "list")
    assert code == 0 and "smollm2-135m-instruct (default)" in out


def test_ask_rapid_mode(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 64)
    code, out = run("ask", "Which ship has a blue hull?", "--store", ws, "--mode", "rapid",
                    "--json", "--max-new-tokens", 6)
    assert code == 0, out
    report = last_json(out)
    assert report["mode"] == "rapid" and report["target_prompt_tokens"] > 0
    assert 0.0 <= report["acceptance_rate"] <= 1.0


def test_demo_runs_in_a_temporary_workspace_and_keeps_the_blobs(tmp_path, docs, model_dir):
    kv = tmp_path / "kv"
    code, out = run("demo", "Which ship has a blue hull?", "--docs", docs, "--model", model_dir,
                    "--store", kv, "--chunk-tokens", 64, "--max-new-tokens", 4)
    assert code == 0, out
    assert "sources: a.md" in out  # named within --docs; the ship's document is retrieved
    assert "TTFT TurboRAG:" in out and "TTFT full prefill:" in out and "x slower" in out
    # the default recovery's work, and the stitched prefill alone beside it
    assert re.search(r"recovery select:0\.15: \d+ chunk tokens recomputed", out), out
    assert "TTFT stitched alone (recovery none):" in out
    assert any(kv.rglob("*.safetensors"))  # the blobs outlive the run's workspace
    code, out = run("demo", "--docs", tmp_path / "missing", "--model", model_dir, "--store", kv)
    assert code == 2 and "no such file or folder" in out


def test_temporary_workspace_is_deleted_on_exit(tmp_path, docs, model_dir):
    from turborag_integrations.workspace import Workspace

    with Workspace.temporary(kv_dir=tmp_path / "kv", model=model_dir, chunk_tokens=64) as ws:
        assert ws.ingest([docs])["ingested"] == 3
        root = ws.root
        assert (root / "chroma").exists() and not (root / "kv").exists()
    assert not root.exists() and any((tmp_path / "kv").rglob("*.safetensors"))


def test_ingest_with_an_encoder_file_keeps_it_in_the_manifest(tmp_path, docs, model_dir):
    """--encoder FILE: chunks are encoded with it, the workspace remembers it, and a file made
    for another model is refused before any blob is written."""
    from turborag_integrations.core.models import load_model
    from tests.core.prefill.test_encoding import encoding_for
    from tests.conftest import tiny_model

    path = encoding_for(load_model(model_dir, progress=False)).save(tmp_path / "enc.safetensors")
    ws = tmp_path / "ws"
    code, out = run("ingest", docs, "--store", ws, "--model", model_dir, "--chunk-tokens", 64,
                    "--encoder", path, "--json")
    assert code == 0, out
    manifest = json.loads((ws / "manifest.json").read_text())
    assert manifest["encoder"] == str(path)
    code, out = run("ask", "Which ship has a blue hull?", "--store", ws, "--json",
                    "--max-new-tokens", 4)
    assert code == 0 and last_json(out)["reused_fraction"] > 0.5, out
    other = encoding_for(tiny_model("llama", seed=7)).save(tmp_path / "other.safetensors")
    code, out = run("ingest", docs, "--store", tmp_path / "ws2", "--model", model_dir,
                    "--encoder", other)
    assert code == 2 and "other model weights" in out
    assert not list((tmp_path / "ws2" / "kv").rglob("*.safetensors"))


def test_vllm_prints_the_server_command_with_the_connector(tmp_path, model_dir):
    import json
    import shlex

    result = runner.invoke(app, ["vllm", "--model", model_dir, "--store", str(tmp_path / "kv"),
                                 "--port", "8123", "--dry-run", "--", "--max-num-seqs", "4"])
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.strip().splitlines()[-1])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == model_dir and "--enforce-eager" in argv
    assert argv[-2:] == ["--max-num-seqs", "4"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "TurboRAGConnector"
    assert config["kv_connector_module_path"] == "turborag_integrations.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["store"] == str(tmp_path / "kv")


def test_vllm_ingest_starts_the_connector_as_kv_both_with_training_free_blobs(tmp_path,
                                                                              model_dir):
    import shlex

    result = runner.invoke(app, ["vllm", "--model", model_dir, "--store", str(tmp_path / "kv"),
                                 "--ingest", "--dry-run"])
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.strip().splitlines()[-1])
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"]["encoder"] == "none"
    result = runner.invoke(app, ["vllm", "--model", model_dir, "--ingest", "--encoder",
                                 "smollm2-135m-instruct", "--dry-run"])
    assert result.exit_code == 2 and "training-free" in result.output


def test_vllm_refuses_what_is_not_a_model(tmp_path):
    result = runner.invoke(app, ["vllm", "--model", str(tmp_path), "--dry-run"])
    assert result.exit_code == 2 and "config.json" in result.output
