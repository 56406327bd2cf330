"""`turborag eval`: a typer command function the main app registers.

    app.command("eval")(eval_command)

`fail` and the bundled data paths serve `turborag finetune` (training/cli.py) too.
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


def fail(message: str, code: int = 2) -> None:
    """Print `message` as an error on stderr and exit with `code` (2: bad input)."""
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
    from ..core.models import DEFAULT_MODEL
    from .harness import evaluate, load_items, markdown_table, temporary_store, write_results

    if not data.exists():
        fail(f"no such file: {data}")
    report = load_items(data)
    for line, reason in report.errors:
        typer.secho(f"{data}:{line}: skipped malformed line: {reason}", fg=typer.colors.YELLOW,
                    err=True)
    if not report.items:
        fail("no valid items to evaluate")
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
        fail(str(exc))
    results["malformed_lines"] = [{"line": n, "reason": r} for n, r in report.errors]
    results["data"] = str(data)
    results["model"] = model or DEFAULT_MODEL
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

