"""`turborag eval` and `turborag finetune`: typer command functions the main app registers.

    app.command("eval")(eval_command)
    app.command("finetune")(finetune_command)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

DEVSET = Path(__file__).resolve().parents[1] / "data" / "devset"
# Hand-written, never trained on or used to choose settings: report on it once.
HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout" / "heldout.jsonl"


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def eval_command(
    data: Path = typer.Argument(DEVSET / "test.jsonl", help="JSONL set: id, question, answers, chunks"),
    model: Optional[str] = typer.Option(None, help="bundled name, local folder or HF id"),
    adapter: str = typer.Option("default", help="LoRA adapter merged at load: 'default' (the one "
                                "shipped for the bundled model), 'none', or a file"),
    modes: str = typer.Option("naive,turbo,turbo-composite,turbo+boundary:16,turbo+blend:0.15",
                              help="comma-separated: naive, turbo, turbo-composite, "
                                   "turbo[-composite]+RECOVERY (boundary:K, blend:R), ft:MODE"),
    finetuned: Optional[Path] = typer.Option(None, help="fine-tuned model folder: adds ft:naive "
                                             "and ft:turbo unless --modes names ft: modes"),
    out: Path = typer.Option(Path("eval-out"), help="folder for results.json, answers.jsonl, "
                             "table.md, plot.png"),
    max_new_tokens: int = typer.Option(24),
    limit: Optional[int] = typer.Option(None, help="evaluate the first N items only"),
    table: bool = typer.Option(True, help="write and print a markdown table"),
    plot: bool = typer.Option(False, help="write plot.png (accuracy vs TTFT; needs matplotlib)"),
    json_out: bool = typer.Option(False, "--json", help="print the results JSON to stdout"),
):
    """Accuracy and TTFT of TurboRAG modes (and recovery / fine-tuned models) on a RAG set."""
    from ..core.engine import TurboRAGEngine
    from ..core.errors import TurboRAGError
    from .harness import evaluate, load_items, markdown_table, temporary_store, write_results

    if not data.exists():
        _fail(f"no such file: {data}")
    report = load_items(data)
    for line, reason in report.errors:
        typer.secho(f"{data}:{line}: skipped malformed line: {reason}", fg=typer.colors.YELLOW,
                    err=True)
    if not report.items:
        _fail("no valid items to evaluate")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    ft_doc = False
    if finetuned is not None:
        if not any(m.startswith("ft:") for m in mode_list):
            mode_list += ["ft:naive", "ft:turbo"]
        meta = finetuned / "turborag_finetune.json"
        if meta.exists():
            info = json.loads(meta.read_text())
            ft_doc = bool(info.get("doc_tokens"))
    try:
        with temporary_store() as base_kv, temporary_store() as ft_kv:
            engine = TurboRAGEngine(model, store=base_kv, progress=False, adapter=adapter)
            ft_engine = TurboRAGEngine(str(finetuned), store=ft_kv, progress=False, adapter=None) \
                if finetuned is not None else None

            def progress(mode, done, total):
                if done == total or done % 10 == 0:
                    typer.echo(f"  {mode}: {done}/{total}", err=True)

            results = evaluate(engine, report.items, mode_list, max_new_tokens=max_new_tokens,
                               ft_engine=ft_engine, ft_doc_tokens=ft_doc, progress=progress,
                               limit=limit)
    except (TurboRAGError, ValueError) as exc:
        _fail(str(exc))
    results["malformed_lines"] = [{"line": n, "reason": r} for n, r in report.errors]
    results["data"] = str(data)
    results["model"] = model or "smollm2-135m-instruct"
    results["adapter"] = str(engine.adapter) if engine.adapter else None
    results["anchor"] = engine.anchor
    if finetuned is not None:
        results["finetuned"] = str(finetuned)
    for s in results["skipped"]:
        typer.secho(f"skipped {s['id']}: {s['reason']}", fg=typer.colors.YELLOW, err=True)
    for note in write_results(results, out, table=table, png=plot):
        typer.secho(note, fg=typer.colors.YELLOW, err=True)
    if json_out:
        json.dump({k: v for k, v in results.items() if k != "answers"}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif table:
        typer.echo(markdown_table(results))
    typer.echo(f"results in {out}/", err=True)


def finetune_command(
    out: Path = typer.Argument(..., help="folder to save the fine-tuned model in"),
    data: Path = typer.Option(DEVSET / "train.jsonl", help="JSONL training set"),
    model: Optional[str] = typer.Option(None, help="base model: bundled name, folder or HF id"),
    steps: int = typer.Option(200, help="optimizer steps"),
    batch_size: int = typer.Option(2),
    lr: float = typer.Option(5e-5, help="learning rate (LoRA: try 5e-4)"),
    positions: str = typer.Option("reordered", help="reordered | composite"),
    lora: bool = typer.Option(False, help="train LoRA adapters (needs peft) and merge them"),
    lora_rank: int = typer.Option(16),
    doc_tokens: bool = typer.Option(False, help="add <|doc_start|>/<|doc_end|> around chunks"),
    max_chunks: Optional[int] = typer.Option(None, help="keep at most N chunks per item "
                                             "(gold always kept): shorter, faster steps"),
    anchor: str = typer.Option("chat", help="chunk anchor of the layout trained on: the engine's "
                               "(chat | bos | none | a text)"),
    max_tokens: int = typer.Option(1536, help="skip longer examples"),
    seed: int = typer.Option(0),
):
    """Fine-tune a model for TurboRAG's independent attention (loss on the answer only)."""
    from ..core.errors import TurboRAGError
    from ..training.finetune import FinetuneConfig, finetune

    if positions not in ("reordered", "composite"):
        _fail("positions must be reordered or composite")
    cfg = FinetuneConfig(model=model, data=str(data), out=str(out), steps=steps,
                         batch_size=batch_size, lr=lr, positions=positions, lora=lora,
                         lora_rank=lora_rank, doc_tokens=doc_tokens, max_chunks=max_chunks,
                         anchor=anchor, max_tokens=max_tokens,
                         seed=seed)
    try:
        summary = finetune(cfg, log=lambda m: typer.echo(m, err=True))
    except (TurboRAGError, ValueError, ImportError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps(summary, indent=2))
