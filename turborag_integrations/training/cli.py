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

from ..evaluation.cli import DEVSET, HANDDEV, HELDOUT, fail


def finetune_command(
    out: Path = typer.Argument(..., help="folder to save the fine-tuned model in"),
    data: Path = typer.Option(DEVSET / "train.jsonl", help="JSONL training set"),
    model: Optional[str] = typer.Option(None, help="base model: bundled name, folder or HF id"),
    steps: int = typer.Option(200, help="optimizer steps"),
    batch_size: int = typer.Option(2),
    lr: Optional[float] = typer.Option(None, help="learning rate (default 5e-5; LoRA: try 5e-4; "
                                       "--encoder: 2e-3, which a 0.5B model needs lowered "
                                       "to 5e-4)"),
    positions: str = typer.Option("reordered", help="reordered | composite"),
    lora: bool = typer.Option(False, help="train LoRA adapters (needs peft) and merge them; with "
                              "--encoder, an encode-only LoRA in the encoder file"),
    lora_rank: int = typer.Option(16),
    doc_tokens: bool = typer.Option(False, help="add <|doc_start|>/<|doc_end|> around chunks"),
    max_chunks: Optional[int] = typer.Option(None, help="keep at most N chunks per item "
                                             "(gold always kept): shorter, faster steps"),
    anchor: str = typer.Option("chat", help="chunk anchor of the layout trained on: the engine's "
                               "(chat | bos | none | a text)"),
    max_tokens: int = typer.Option(1536, help="skip longer examples"),
    seed: int = typer.Option(0),
    encoder: bool = typer.Option(False, "--encoder", help="train a learned chunk encoding "
                                 "instead of the model: soft tokens and/or an encode-only LoRA "
                                 "by self-distillation from the full prefill (no labels); saves "
                                 "OUT/encoder.safetensors for TurboRAGEngine(encoder=...)"),
    soft_tokens: int = typer.Option(8, help="--encoder: soft tokens before each chunk (0: none)"),
    ce_weight: float = typer.Option(0.0, help="--encoder: weight of the reply's cross-entropy "
                                    "beside the KL"),
    min_chunks: int = typer.Option(1, help="--encoder: skip items with fewer chunks"),
    save_every: int = typer.Option(0, help="--encoder: also save every N steps"),
    init: Optional[Path] = typer.Option(None, help="--encoder: continue training this encoder "
                                        "file (same model, anchor, soft tokens and rank)"),
    context_tokens: int = typer.Option(0, help="--encoder: encode each training chunk after up "
                                       "to N tokens of text before it, as the engine's "
                                       "context encoding does (0: each chunk alone)"),
    eval_set: Optional[list[Path]] = typer.Option(
        None, "--eval-set", help="evaluation sets the training data must not share a question "
        "or chunk with (repeatable; default: the bundled hand-written dev and held-out sets)"),
):
    """Fine-tune a model for TurboRAG's independent attention (loss on the answer only), or
    with --encoder train a chunk encoding that leaves the model as it is."""
    from ..core.errors import TurboRAGError

    if positions not in ("reordered", "composite"):
        fail("positions must be reordered or composite")
    eval_sets = eval_set if eval_set else [HANDDEV, HELDOUT]
    if encoder:
        from .distill import DistillConfig, distill

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
        return
    from .distill import check_disjoint
    from .finetune import FinetuneConfig, finetune
    from ..evaluation.harness import load_items

    try:
        check_disjoint(load_items(data).items if data.exists() else [], eval_sets)
    except ValueError as exc:
        fail(str(exc))
    cfg = FinetuneConfig(model=model, data=str(data), out=str(out), steps=steps,
                         batch_size=batch_size, lr=5e-5 if lr is None else lr,
                         positions=positions, lora=lora,
                         lora_rank=lora_rank, doc_tokens=doc_tokens, max_chunks=max_chunks,
                         anchor=anchor, max_tokens=max_tokens, seed=seed)
    try:
        summary = finetune(cfg, log=lambda m: typer.echo(m, err=True))
    except (TurboRAGError, ValueError, ImportError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(summary, indent=2))
