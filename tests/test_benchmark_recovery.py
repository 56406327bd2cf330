"""benchmarks/recovery.py: captured pipeline prompts answered by each recovery from one store,
on a tiny model saved to disk (real MiniLM embeddings, embedded Chroma)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.test_benchmark_pipelines import ITEMS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "recovery.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_recovery", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capture_ingest_then_every_token_recomputed_is_the_full_prefill(bench, model_dir,
                                                                        tmp_path, capsys):
    """The captured replies are the full prefill's; select:1 recomputes every chunk token, so
    its greedy replies equal them on every prompt and its teacher-forced KL is zero; the
    stitched prefill alone recomputes nothing."""
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in ITEMS))
    captured, store = tmp_path / "captured.jsonl", str(tmp_path / "kv")
    assert bench.main(["capture", str(data), str(captured), "--model", model_dir,
                       "--max-new-tokens", "4", "--k", "2"]) == 0
    rows = [json.loads(line) for line in captured.read_text().splitlines()]
    assert len(rows) == len(ITEMS) * 2 and all(r["chunks"] for r in rows)
    assert all(all(c in r["prompt"] for c in r["chunks"]) for r in rows)
    assert bench.main(["ingest", str(data), "--model", model_dir, "--store", store,
                       "--engine-arg", "context_tokens=16"]) == 0
    capsys.readouterr()
    common = [str(captured), "--model", model_dir, "--store", store, "--max-new-tokens", "4",
              "--engine-arg", "context_tokens=16", "--lead", "--json"]
    assert bench.main(["answer", *common, "--recovery", "none", "--recovery", "select:1"]) == 0
    report = json.loads(capsys.readouterr().out)
    by = {r["recovery"]: r for r in report["results"]}
    assert by["select:1"]["same_reply_pct"] == 100.0
    assert by["select:1"]["right"] == report["full_prefill_right"]
    assert by["none"]["mean_recomputed_share"] == 0.0
    assert bench.main(["kl", *common, "--recovery", "select:1", "--recovery", "random:0.5"]) == 0
    kl = {r["recovery"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert kl["select:1"]["mean_kl"] < 1e-6 and kl["select:1"]["top1_pct"] == 100.0


def test_a_bad_recovery_is_refused_before_any_model_loads(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["answer", str(tmp_path / "none.jsonl"), "--recovery", "edges:3"])
    assert exc.value.code == 2
    assert "--recovery: unknown recovery 'edges:3'" in capsys.readouterr().err
