"""`turborag finetune`: a typer command function the main app registers.

    app.command("finetune")(finetune_command)

Training builds on evaluation (its items, prompt and bundled dev set), never the reverse.
torch and the trainer load only when the command runs, so that `turborag --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..evaluation.cli import DEVSET, fail


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
    from .finetune import FinetuneConfig, finetune

    if positions not in ("reordered", "composite"):
        fail("positions must be reordered or composite")
    cfg = FinetuneConfig(model=model, data=str(data), out=str(out), steps=steps,
                         batch_size=batch_size, lr=lr, positions=positions, lora=lora,
                         lora_rank=lora_rank, doc_tokens=doc_tokens, max_chunks=max_chunks,
                         anchor=anchor, max_tokens=max_tokens, seed=seed)
    try:
        summary = finetune(cfg, log=lambda m: typer.echo(m, err=True))
    except (TurboRAGError, ValueError, ImportError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(summary, indent=2))
