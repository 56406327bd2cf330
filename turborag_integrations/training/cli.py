"""`turborag finetune --encoder`: a typer command function the main app registers.

    app.command("finetune")(finetune_command)

It trains the learned chunk encoder (distill.py); the model itself is never changed. Training
builds on evaluation (its items, prompt and bundled dev set), never the reverse. torch and the
trainer load only when the command runs, so that `turborag --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..evaluation.cli import DEVSET, HANDDEV, HELDOUT, fail


def finetune_command(
    out: Path = typer.Argument(..., help="folder to save encoder.safetensors in"),
    data: Path = typer.Option(DEVSET / "train.jsonl", help="JSONL training set"),
    model: Optional[str] = typer.Option(None, help="base model: bundled name, folder or HF id"),
    steps: int = typer.Option(200, help="optimizer steps"),
    lr: Optional[float] = typer.Option(None, help="learning rate (default 2e-3, which a 0.5B "
                                       "model needs lowered to 5e-4)"),
    lora: bool = typer.Option(False, help="also train an encode-only LoRA, saved in the encoder "
                              "file (the model's weights never change)"),
    lora_rank: int = typer.Option(16),
    anchor: str = typer.Option("chat", help="chunk anchor of the layout trained on: the engine's "
                               "(chat | bos | none | a text)"),
    max_tokens: int = typer.Option(1536, help="skip longer examples"),
    seed: int = typer.Option(0),
    encoder: bool = typer.Option(False, "--encoder", help="train a learned chunk encoding "
                                 "(required): soft tokens and/or an encode-only LoRA by "
                                 "self-distillation from the full prefill (no labels); saves "
                                 "OUT/encoder.safetensors for TurboRAGEngine(encoder=...)"),
    soft_tokens: int = typer.Option(8, help="soft tokens before each chunk (0: none)"),
    ce_weight: float = typer.Option(0.0, help="weight of the reply's cross-entropy beside the KL"),
    min_chunks: int = typer.Option(1, help="skip items with fewer chunks"),
    save_every: int = typer.Option(0, help="also save every N steps"),
    init: Optional[Path] = typer.Option(None, help="continue training this encoder file (same "
                                        "model, anchor, soft tokens and rank)"),
    context_tokens: int = typer.Option(0, help="encode each training chunk after up to N tokens "
                                       "of text before it, as the engine's context encoding "
                                       "does (0: each chunk alone)"),
    eval_set: Optional[list[Path]] = typer.Option(
        None, "--eval-set", help="evaluation sets the training data must not share a question "
        "or chunk with (repeatable; default: the bundled hand-written dev and held-out sets)"),
):
    """Train a learned chunk encoding (--encoder) that leaves the model as it is."""
    from ..core.errors import TurboRAGError
    from .distill import DistillConfig, distill

    # the flag stays required so that a command line written for this command says what it
    # trains: the chunk encoder, never the model's weights
    if not encoder:
        fail("turborag finetune trains the learned chunk encoder only: pass --encoder")
    eval_sets = eval_set if eval_set else [HANDDEV, HELDOUT]
    cfg = DistillConfig(model=model, data=str(data), out=str(out), steps=steps,
                        lr=2e-3 if lr is None else lr,
                        soft_tokens=soft_tokens, lora_rank=lora_rank if lora else 0,
                        anchor=anchor, ce_weight=ce_weight, max_tokens=max_tokens,
                        min_chunks=min_chunks, seed=seed, save_every=save_every,
                        init=str(init) if init else None, context_tokens=context_tokens)
    try:
        summary = distill(cfg, eval_sets=eval_sets, log=lambda m: typer.echo(m, err=True))
    except (TurboRAGError, ValueError, ImportError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(summary, indent=2))
