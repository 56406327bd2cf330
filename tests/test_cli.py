"""The `turborag` command line, end to end on a tiny model saved to disk (a local-folder model)."""

import json
import re

import pytest
import torch
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
    code, out = run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64,
                    "--json")
    assert code == 0, out
    counts = last_json(out)
    assert counts["ingested"] == 3 and counts["chunks"] >= 3
    code, out = run("ingest", docs, "--workspace", ws, "--json")
    assert last_json(out)["skipped"] == 3
    code, out = run("ask", "Which ship has a blue hull?", "--workspace", ws, "--json",
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
    code, out = run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 48,
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
    code, out = run("ingest", docs, "--workspace", ws, "--json")
    assert code == 0 and last_json(out)["skipped"] == 1


def test_changed_file_is_reingested(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64)
    (docs / "b.txt").write_text("The bakery moved to Harbour Lane and now opens at seven.")
    code, out = run("ingest", docs, "--workspace", ws, "--json")
    counts = last_json(out)
    assert counts["ingested"] == 1 and counts["skipped"] == 2


def test_store_verify_finds_corruption(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64)
    assert run("store", "verify", "--workspace", ws)[0] == 0
    blob = next((ws / "kv" / "blobs").rglob("*.safetensors"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    code, out = run("store", "verify", "--workspace", ws)
    assert code == 1 and "checksum" in out


def test_store_gc_shrinks_the_store_to_a_size(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 16)
    code, out = run("store", "stats", "--workspace", ws, "--json")
    before = last_json(out)
    assert code == 0 and before["blobs"] >= 4 and before["budget_bytes"] > before["bytes"]
    target = before["bytes"] // 2
    code, out = run("store", "gc", "--workspace", ws, "--max-bytes", f"{target / 1000:.3f}kB")
    assert code == 0, out
    assert "cold blob(s) evicted" in out
    after = last_json(run("store", "stats", "--workspace", ws, "--json")[1])
    assert 0 < after["bytes"] <= target and after["blobs"] < before["blobs"]
    code, out = run("store", "gc", "--workspace", ws, "--max-bytes", "lots")
    assert code == 2 and "not a size" in out


def test_clear_errors(tmp_path, docs, model_dir):
    code, out = run("ask", "anything", "--workspace", tmp_path / "empty", "--model", model_dir)
    assert code == 2 and "no documents yet" in out
    assert f"turborag ingest PATH --workspace {tmp_path / 'empty'}" in out
    assert not (tmp_path / "empty").exists()  # a question over nothing leaves nothing behind
    code, out = run("ask", "anything", "--workspace", tmp_path / "empty", "--draft", "int4")
    assert code == 2 and "draft must be one of" in out
    code, out = run("ingest", tmp_path / "missing", "--workspace", tmp_path / "ws")
    assert code == 2 and "no such file or folder" in out
    code, out = run("ingest", docs, "--workspace", tmp_path / "ws2", "--model", "no-such-model")
    assert code == 2 and "unknown model" in out
    code, out = run("models", "prepare", "nope")
    assert code == 2 and "unknown bundled model" in out


def test_models_list():
    code, out = run("models", "list")
    assert code == 0 and "smollm2-135m-instruct (default)" in out


def test_ask_rapid_mode(tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64)
    code, out = run("ask", "Which ship has a blue hull?", "--workspace", ws, "--mode", "rapid",
                    "--json", "--max-new-tokens", 6)
    assert code == 0, out
    report = last_json(out)
    assert report["mode"] == "rapid" and report["target_prompt_tokens"] > 0
    assert 0.0 <= report["acceptance_rate"] <= 1.0


def test_demo_runs_in_a_temporary_workspace_and_keeps_the_blobs(tmp_path, docs, model_dir):
    kv = tmp_path / "kv"
    code, out = run("demo", "Which ship has a blue hull?", "--docs", docs, "--model", model_dir,
                    "--kv-store", kv, "--chunk-tokens", 64, "--max-new-tokens", 4)
    assert code == 0, out
    assert "sources: a.md" in out  # named within --docs; the ship's document is retrieved
    assert "TTFT TurboRAG:" in out and "TTFT full prefill:" in out and "x slower" in out
    # the default recovery's work, and the stitched prefill alone beside it
    assert re.search(r"recovery select:0\.15: \d+ chunk tokens recomputed", out), out
    assert "TTFT stitched alone (recovery none):" in out
    assert any(kv.rglob("*.safetensors"))  # the blobs outlive the run's workspace
    code, out = run("demo", "--docs", tmp_path / "missing", "--model", model_dir, "--kv-store", kv)
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
    code, out = run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64,
                    "--encoder", path, "--json")
    assert code == 0, out
    manifest = json.loads((ws / "manifest.json").read_text())
    assert manifest["encoder"] == str(path)
    code, out = run("ask", "Which ship has a blue hull?", "--workspace", ws, "--json",
                    "--max-new-tokens", 4)
    assert code == 0 and last_json(out)["reused_fraction"] > 0.5, out
    other = encoding_for(tiny_model("llama", seed=7)).save(tmp_path / "other.safetensors")
    code, out = run("ingest", docs, "--workspace", tmp_path / "ws2", "--model", model_dir,
                    "--encoder", other)
    assert code == 2 and "other model weights" in out
    assert not list((tmp_path / "ws2" / "kv").rglob("*.safetensors"))


def test_vllm_prints_the_server_command_with_the_connector(tmp_path, model_dir):
    import json
    import shlex

    result = runner.invoke(app, ["vllm", "--model", model_dir, "--kv-store", str(tmp_path / "kv"),
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

    result = runner.invoke(app, ["vllm", "--model", model_dir, "--kv-store", str(tmp_path / "kv"),
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


# ---- one meaning per option name ----------------------------------------------------------

def _options(command, path=()):
    """(command path, option) of every option of every command under `command` (a click
    command tree, as typer builds it)."""
    if hasattr(command, "commands"):  # a group
        for name, sub in command.commands.items():
            yield from _options(sub, (*path, name))
    else:
        for param in command.params:
            if param.param_type_name == "option":
                yield " ".join(path), param


def _meanings() -> dict[str, dict[str, list[str]]]:
    """Each visible option's long name → its meanings (its help up to the default it names)
    → the commands that take it so."""
    import typer

    found: dict[str, dict[str, list[str]]] = {}
    for command, option in _options(typer.main.get_command(app)):
        if option.hidden:
            continue
        meaning = (option.help or "").split(" (default")[0]
        for name in option.opts:
            if name.startswith("--"):
                found.setdefault(name, {}).setdefault(meaning, []).append(command)
    return found


def test_one_meaning_per_option_name():
    """--workspace is a workspace folder and --kv-store a KV store folder wherever they are
    taken, each with one help; --store, which meant either, is taken visibly nowhere; and no
    other option is described as either folder."""
    meanings = _meanings()
    assert "--store" not in meanings and "--store-dir" not in meanings
    assert len(meanings["--workspace"]) == 1 and len(meanings["--kv-store"]) == 1
    [(workspace, workspace_commands)] = meanings["--workspace"].items()
    [(kv_store, kv_commands)] = meanings["--kv-store"].items()
    assert workspace.startswith("workspace folder") and kv_store.startswith("KV store folder")
    assert sorted(workspace_commands) == ["ask", "chat", "ingest", "store gc", "store stats",
                                          "store verify"]
    assert sorted(kv_commands) == ["demo", "serve", "vllm"]
    for name, by_meaning in meanings.items():
        for meaning in by_meaning:
            if meaning.lower().startswith(("workspace folder", "kv store folder")):
                assert name in ("--workspace", "--kv-store"), (name, meaning)


@pytest.mark.parametrize("args, replacement", [
    (["ingest", "x", "--store", "y"], "--store is now --workspace"),
    (["ask", "q", "--store", "y"], "--store is now --workspace"),
    (["store", "stats", "--store", "y"], "--store is now --workspace"),
    (["store", "gc", "--store=y"], "--store is now --workspace"),
    (["demo", "--store", "kv"], "--store is now --kv-store"),
    (["serve", "--store", "kv"], "--store is now --kv-store"),
    (["vllm", "--store", "kv", "--dry-run"], "--store is now --kv-store"),
    (["vllm", "--store-dir", "d", "--dry-run"], "--store-dir is now --kv-store-dir"),
])
def test_the_old_store_option_names_its_replacement(tmp_path, monkeypatch, args, replacement):
    """A script that still gives --store is stopped before anything runs, with the option to
    give instead; nothing is created."""
    monkeypatch.chdir(tmp_path)
    code, out = run(*args)
    assert code == 2 and replacement in out, out
    assert len([line for line in out.splitlines() if line.strip()]) == 1
    assert list(tmp_path.iterdir()) == []


def test_serve_vllm_and_the_chroma_suggestion_have_distinct_default_ports():
    import typer

    root = typer.main.get_command(app)

    def default(command: str, param: str):
        return next(p for p in root.commands[command].params if p.name == param)

    ports = {name: default(name, "port").default for name in ("serve", "vllm")}
    assert ports == {"serve": 8000, "vllm": 8100}
    chroma = default("ingest", "chroma_url").help
    assert "--port 8200" in chroma and "http://127.0.0.1:8200" in chroma


def test_loading_flags_reach_the_model_and_bad_ones_fail_before_it_loads(tmp_path, docs,
                                                                         model_dir):
    ws = tmp_path / "ws"
    code, out = run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64,
                    "--dtype", "bfloat16", "--model-kwargs", '{"pad_token_id": 7}', "--json")
    assert code == 0, out
    # the blobs were made by a bf16 model: asked in bf16 they are reused, in fp32 they are not
    code, out = run("ask", "Which ship has a blue hull?", "--workspace", ws, "--json",
                    "--max-new-tokens", 4, "--dtype", "bfloat16")
    assert code == 0, out
    assert last_json(out)["reused_fraction"] > 0.5
    from turborag_integrations.core.models import ModelConfig
    from turborag_integrations.workspace import Workspace

    engine = Workspace(ws, loading=ModelConfig(dtype="bfloat16",
                                               model_kwargs={"pad_token_id": 7})).engine
    assert engine.model.dtype == torch.bfloat16 and engine.model.config.pad_token_id == 7
    for args, says in [
        (("--device", "cuda:0"), "--device: device 'cuda:0' is not available"),
        (("--dtype", "fp7"), "--dtype: unknown dtype 'fp7'"),
        (("--model-kwargs", "{bad"), "--model-kwargs is not JSON"),
        (("--model-kwargs", "[1]"), "--model-kwargs must be a JSON object"),
        (("--tokenizer-kwargs", '"x"'), "--tokenizer-kwargs must be a JSON object"),
        (("--model-kwargs", '{"torch_dtype": "float16"}'), "give the dtype as dtype="),
    ]:
        if args[0] == "--device" and torch.cuda.is_available():
            continue
        for command in (("ask", "q", "--workspace", tmp_path / "none"),
                        ("ingest", docs, "--workspace", tmp_path / "none"),
                        ("serve", "--model", model_dir), ("demo", "--model", model_dir)):
            code, out = run(*command, *args)
            assert code == 2 and says in out, (command, args, out)
    assert not (tmp_path / "none").exists()  # refused before a workspace was made
    code, out = run("ask", "q", "--workspace", ws, "--model-kwargs", '{"bogus_argument": 1}')
    assert code == 2 and "transformers refused a keyword argument" in out and "bogus_argument" in out
