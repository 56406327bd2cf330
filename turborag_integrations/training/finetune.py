"""Fine-tune a model for stitched (independently attended) chunk caches.

Each training example is a prompt in TurboRAG's layout (collator.py): chunks see only
themselves (and the anchor the engine encodes them after), everything else sees all before it,
positions reordered (or composite), loss on the reply only. The prompt is the evaluation prompt,
or — for items of a training mix (training/mix.py) that name a template — the exact text a stock
LlamaIndex or LangChain pipeline sends (training/templates.py), with a short answer or, for an
item whose context lacks the fact, a refusal.

Full fine-tuning or LoRA (peft). The saved folder is a plain transformers model (LoRA merged)
that `TurboRAGEngine(folder)` and `turborag eval --finetuned` load; with LoRA the deltas alone are
also saved as `adapter.safetensors` (core/adapter.py), a few MB that `TurboRAGEngine(adapter=...)`
merges into the base model at load. `turborag_finetune.json` records how it was trained.

    python -m turborag_integrations.training.mix --out mix.jsonl --n 1200 --seed 7
    turborag finetune out/smollm2-turbo --data mix.jsonl --lora --lora-rank 8 --steps 400
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core.adapter import save_adapter
from ..core.prefill.anchor import anchor_ids
from ..core.kv.blob import weights_digest
from ..core.models import load_model
from ..evaluation.harness import load_items
from .collator import (TurboRAGCollator, add_doc_tokens, answer_loss, build_example,
                       example_from_prompt)
from . import optim
from .mix import target_reply
from .templates import render

META_FILE = "turborag_finetune.json"


@dataclass
class FinetuneConfig(optim.TrainingRun):
    batch_size: int = 2
    weight_decay: float = 0.0
    positions: str = "reordered"
    lora: bool = False
    lora_rank: int = 16
    doc_tokens: bool = False
    max_chunks: int | None = None
    freeze_embeddings: bool = True  # tied 28M-parameter table: slow to update, rarely needed


def make_example(tok, item, chunks, cfg: FinetuneConfig, anchor: list[int]):
    """The training example of one item: its template's prompt (the evaluation prompt when it
    names none) and the reply it should get."""
    if (item.template or "eval") != "eval" or item.unanswerable:
        rendered = render(item.template or "eval", tok, item.question, chunks,
                          target_reply(item, item.template or "eval"))
        return example_from_prompt(tok, rendered.prompt, rendered.chunk_texts,
                                   rendered.completion, positions=cfg.positions,
                                   anchor_ids=anchor)
    return build_example(tok, item.question, chunks, item.answers[0], positions=cfg.positions,
                         doc_tokens=cfg.doc_tokens, anchor_ids=anchor)


def lora_deltas(peft_model) -> dict:
    """{module name in the base model: (A, B, scale)} of a peft LoRA model."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            base_name = name.removeprefix("base_model.model.")
            out[base_name] = (module.lora_A["default"].weight, module.lora_B["default"].weight,
                              module.scaling["default"])
    return out


def _subset_chunks(item, max_chunks: int | None, rng: random.Random) -> list[str]:
    if not max_chunks or len(item.chunks) <= max_chunks:
        return item.chunks
    gold = [i for i in item.gold if 0 <= i < len(item.chunks)]
    rest = [i for i in range(len(item.chunks)) if i not in gold]
    keep = sorted(gold + rng.sample(rest, max(0, max_chunks - len(gold))))
    return [item.chunks[i] for i in keep]


def finetune(cfg: FinetuneConfig, *, loaded=None, log: Callable[[str], None] = print) -> dict:
    """Train and save; returns a summary (losses, time). `loaded` overrides cfg.model (tests)."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    loaded = loaded or load_model(cfg.model, progress=False)
    model, tok = loaded.model, loaded.tokenizer
    report = load_items(cfg.data)
    if report.errors:
        log(f"skipping {len(report.errors)} malformed lines: {report.errors[:3]}")
    if not report.items:
        raise ValueError(f"no training items in {cfg.data}")
    base_weights = weights_digest(model)
    new_ids = add_doc_tokens(tok, model) if cfg.doc_tokens else []
    anchor = anchor_ids(cfg.anchor, tok)
    examples = [make_example(tok, it, _subset_chunks(it, cfg.max_chunks, rng), cfg, anchor)
                for it in report.items]
    window = min(loaded.context_window, cfg.max_tokens)
    examples = [e for e in examples if len(e.input_ids) <= window]
    log(f"{len(examples)} examples, median {sorted(len(e.input_ids) for e in examples)[len(examples) // 2]} tokens")

    model.train()
    if cfg.lora:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ImportError("LoRA needs peft: pip install peft") from None
        extra = {"trainable_token_indices": {"embed_tokens": new_ids}} if new_ids else {}
        model = get_peft_model(model, LoraConfig(
            r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"], **extra))
    elif cfg.freeze_embeddings and not new_ids:
        model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = optim.optimizer(params, cfg.lr, cfg.warmup, cfg.steps, cfg.weight_decay)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    collate = TurboRAGCollator(pad, next(model.parameters()).dtype)
    order: list[int] = []
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch = collate([examples[order.pop()] for _ in range(cfg.batch_size)])
        losses.append(optim.step(answer_loss(model, batch), params, opt, sched))
        optim.report(log, step + 1, cfg.steps, losses, t0)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.lora:
        if not new_ids:  # an adapter cannot carry new vocabulary
            save_adapter(out / "adapter.safetensors", lora_deltas(model), base_weights,
                         meta={"base_model": loaded.name, "anchor": cfg.anchor,
                               "steps": cfg.steps, "lr": cfg.lr, "rank": cfg.lora_rank,
                               "seed": cfg.seed, "data": Path(cfg.data).name})
        model = model.merge_and_unload()
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    summary = {"steps": cfg.steps, "examples": len(examples), "first_loss": losses[0],
               "final_loss": sum(losses[-10:]) / len(losses[-10:]),
               "train_s": time.perf_counter() - t0, "config": asdict(cfg)}
    (out / META_FILE).write_text(json.dumps({"doc_tokens": cfg.doc_tokens,
                                             "positions": cfg.positions, **summary}, indent=2))
    return summary
