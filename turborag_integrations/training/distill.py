"""Train a learned chunk encoding by self-distillation: the stitched prompt learns to read like
the full one, with the model itself left unchanged.

Teacher: the unmodified model's full causal prefill of a prompt, then the reply (teacher-forced).
Student: the same model over the same prompt laid out as TurboRAG stitches it (chunks attend only
to themselves, after the anchor, with `context_tokens` a made-up text of their document before
them, and the soft tokens; every other token sees all before it), with the encoder's parameters
acting on the chunk spans alone. Loss: KL(teacher ‖ student) of the next-token distributions at
every reply position (plus, optionally, the reply's cross-entropy).
No labels are needed: the teacher says what the model would have said.

What is trained (core/prefill/encoding.py): `soft_tokens` input embeddings before every chunk,
an encode-only LoRA of `lora_rank` on the projections, or both. The base weights never change, so
the saved file is small and the query-time model is the user's model.

    python -m turborag_integrations.training.mix --out mix.jsonl --n 600 --seed 11
    turborag finetune out --data mix.jsonl --encoder --soft-tokens 8 --lora-rank 8 --steps 400
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..core.models import load_model
from ..core.prefill.anchor import anchor_ids
from ..core.prefill.context import CONTEXT_JOIN, context_token_ids
from ..core.kv.blob import fingerprint_model
from ..core.prefill.encoding import LearnedEncoding, new_lora
from ..core.prefill.segment import (Piece, is_separator, split_prompt, token_pieces,
                                    tokenize_with_starts)
from ..core.prefill.separators import separator_ids
from ..core.prefill.stitch import Segment, independent_attention_mask, layout, plan_prompt
from ..evaluation.harness import load_items
from . import optim
from .mix import target_reply
from .templates import render

ENCODER_FILE = "encoder.safetensors"
META_FILE = "turborag_encoder.json"


@dataclass
class DistillConfig(optim.TrainingRun):
    steps: int = 300
    lr: float = 2e-3
    soft_tokens: int = 8
    lora_rank: int = 0
    ce_weight: float = 0.0  # weight of the reply's cross-entropy beside the KL
    min_chunks: int = 1
    save_every: int = 0  # also write the encoder every N steps (a long run can be stopped)
    init: str | None = None  # continue from this encoder file (its soft tokens and LoRA)
    # Train on chunks encoded after a context, as the engine encodes them by default
    # (core/prefill/context.py): up to this many tokens of text before each chunk (0: alone).
    context_tokens: int = 0


@dataclass
class DistillExample:
    teacher_ids: list[int]  # the whole prompt as one text, then the reply
    teacher_reply_at: int  # index of the token whose logits predict the reply's first token
    ids: list[int]  # the stitched layout, then the reply
    positions: list[int]
    spans: list[tuple[int, int, int]]  # (start, length, hidden) of independently attended spans
    chunk_spans: list[tuple[int, int, int]]  # the chunks among them (not the plain prompt head)
    reply_at: int  # like teacher_reply_at, in the layout
    reply: list[int]
    soft_at: list[int]  # where each chunk span's soft slots start
    context_len: int  # context tokens in the layout (none in the teacher)

    def mask(self) -> torch.Tensor:
        return independent_attention_mask(len(self.ids), self.spans)


class _TokensOnly:
    """Stands in for a KVBlob in `plan_prompt`, which needs only a chunk's token ids."""

    fingerprint = None

    def __init__(self, ids: Sequence[int], base_position: int = 0, head: bool = False):
        self.token_ids = torch.as_tensor(list(ids), dtype=torch.long)
        self.base_position = base_position
        self.is_head = head  # the prompt's head: cached plain, never a chunk

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def prompt_segments(tokenizer, prompt: str, chunk_texts: Sequence[str],
                    cache_prefix: bool = True, anchor_len: int = 0) -> list[Segment]:
    """The engine's segmentation of `prompt` (see PromptAssembly.segments), with token-only blobs:
    chunks encoded after an `anchor_len`-token anchor, the prompt's head plain."""
    def own_ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    tokens = tokenize_with_starts(tokenizer, prompt)
    if tokens is None:  # the engine's fallback too: each piece tokenized alone
        pieces = [Piece(text, tuple(own_ids(text)), text if is_chunk else None)
                  for text, is_chunk in split_prompt(prompt, chunk_texts)]
    else:
        pieces = token_pieces(prompt, *tokens, chunk_texts, own_ids)
    separators = {tuple(run) for run in separator_ids(tokenizer)}
    segments = []
    for i, piece in enumerate(pieces):
        # a stock separator between two chunks is encoded like a chunk (engine.assembly.segments)
        is_chunk = piece.chunk is not None or is_separator(pieces, i, separators)
        cached = is_chunk or (i == 0 and cache_prefix and any(p.chunk for p in pieces[1:]))
        blob = _TokensOnly(piece.ids, anchor_len if is_chunk else 0, not is_chunk) \
            if cached else None
        segments.append(Segment(piece.text, blob, None if cached else piece.ids))  # type: ignore[arg-type]
    return segments


def make_example(tok, prompt: str, chunk_texts: Sequence[str], completion: str,
                 anchor: Sequence[int], num_soft: int, pad_id: int,
                 contexts: Sequence[Sequence[int]] | None = None) -> DistillExample:
    """Teacher and student sequences of one rendered prompt and its completion.

    The student's prompt is split and tokenized exactly as the engine splits it (training and
    inference must see the same tokens); each chunk span starts with its copy of the anchor and
    `num_soft` placeholder slots, which the soft tokens' embeddings replace in the forward.
    `contexts` (one token-id list per chunk text, from `ChunkEncoder.context_ids`) puts each
    chunk's context between its anchor and its soft slots, hidden from the rest of the prompt
    like the anchor: the layout of a blob encoded after its document's text."""
    head = list(anchor) + [pad_id] * num_soft
    segments = prompt_segments(tok, prompt, chunk_texts, anchor_len=len(head))
    plan = plan_prompt(segments, tok)
    lay = layout(plan, head)
    reply = tok(completion, add_special_tokens=False)["input_ids"]
    start = plan.next_position + len(head)
    # the prompt's head (text before the first chunk) is cached plain, never with the encoder
    has_head = bool(segments) and getattr(segments[0].blob, "is_head", False)
    span_ctx = _span_contexts(segments, plan, chunk_texts, contexts)
    ids, positions, spans, chunk_spans, soft_at = _with_contexts(
        lay, span_ctx, len(anchor), num_soft, skip_first=has_head)
    teacher = tok(prompt, add_special_tokens=False)["input_ids"]
    return DistillExample(teacher + reply, len(teacher) - 1, ids + reply,
                          positions + list(range(start, start + len(reply))), spans,
                          chunk_spans, len(ids) - 1, reply, soft_at,
                          sum(len(c) for c in span_ctx))


def _span_contexts(segments, plan, chunk_texts: Sequence[str],
                   contexts: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """The context ids of each of the plan's cached spans, in order: its chunk's, or none (the
    prompt's head, a separator encoded like a chunk)."""
    if contexts is None:
        return [[] for _ in plan.spans]
    if len(contexts) != len(chunk_texts):
        raise ValueError(f"{len(contexts)} contexts for {len(chunk_texts)} chunks: give one per "
                         "chunk (empty for none)")
    by_text: dict[str, list[list[int]]] = {}
    for text, ctx in zip(chunk_texts, contexts):
        by_text.setdefault(text.strip(), []).append(list(ctx))
    of_blob = {}
    for seg in segments:
        queue = by_text.get(seg.text.strip()) if seg.blob is not None else None
        if queue:
            of_blob[id(seg.blob)] = queue.pop(0)
    return [of_blob.get(id(span.blob), []) for span in plan.spans]


def _with_contexts(lay, span_ctx: Sequence[Sequence[int]], anchor_len: int, num_soft: int,
                   skip_first: bool):
    """The layout with each span's context inserted after its anchor copy (and before its soft
    slots), as ChunkEncoder.encode_ids lays a chunk out: the span's hidden head grows by the
    context, and its positions run back from the chunk's first token (RoPE sees only the
    distances, which equal the encoder's)."""
    ids: list[int] = []
    pos: list[int] = []
    spans: list[tuple[int, int, int]] = []
    chunk_spans: list[tuple[int, int, int]] = []
    soft_at: list[int] = []
    by_start = {s: (length, hidden, list(ctx))
                for (s, length, hidden), ctx in zip(lay.spans, span_ctx)}
    i = 0
    while i < len(lay.token_ids):
        if i not in by_start:
            ids.append(lay.token_ids[i])
            pos.append(lay.positions[i])
            i += 1
            continue
        length, hidden, ctx = by_start[i]
        head = lay.token_ids[i:i + hidden]
        if ctx:
            head = head[:anchor_len] + ctx + head[anchor_len:]
        first = lay.positions[i + hidden]  # the chunk's first token (or the span's, hidden 0)
        span = (len(ids), length + len(ctx), hidden + len(ctx))
        ids.extend(head + lay.token_ids[i + hidden:i + length])
        pos.extend(list(range(first - len(head), first)) + lay.positions[i + hidden:i + length])
        spans.append(span)
        if not (skip_first and span[0] == 0):
            chunk_spans.append(span)
            soft_at.append(span[0] + span[2] - num_soft)
        i += length
    return ids, pos, spans, chunk_spans, soft_at


def student_logits(model, enc: LearnedEncoding, ex: DistillExample,
                   num_reply: int | None = None) -> torch.Tensor:
    """[reply, vocab] float32 logits of the stitched forward at the reply positions, the
    encoder's LoRA on the chunk spans only (the definition the engine reproduces: a blob's KV is
    computed with it, every other token without)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    n = len(ex.ids)
    ids = torch.tensor([ex.ids], device=device)
    embeds = model.get_input_embeddings()(ids)
    if enc.num_soft:
        # every chunk span has its own soft slots (after its anchor and context, right before
        # the chunk): write them one span at a time
        soft = enc.soft.to(dtype)
        for at in ex.soft_at:
            embeds = torch.cat([embeds[:, :at], soft[None], embeds[:, at + enc.num_soft:]], dim=1)
    token_mask = torch.zeros(1, n, device=device)
    for s, length, _ in ex.chunk_spans:
        token_mask[0, s:s + length] = 1
    allowed = ex.mask().to(device)
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)
    with enc.active(model, token_mask):
        out = model.model(inputs_embeds=embeds, position_ids=torch.tensor([ex.positions],
                                                                          device=device),
                          attention_mask=additive[None, None], use_cache=False)
    k = len(ex.reply) if num_reply is None else num_reply
    hidden = out.last_hidden_state[0, ex.reply_at:ex.reply_at + k]
    return model.lm_head(hidden).float()


@torch.no_grad()
def teacher_logits(model, ex: DistillExample) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model.model(input_ids=torch.tensor([ex.teacher_ids], device=device), use_cache=False)
    hidden = out.last_hidden_state[0, ex.teacher_reply_at:ex.teacher_reply_at + len(ex.reply)]
    return model.lm_head(hidden).float()


def kl_loss(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student), in nats."""
    t = torch.log_softmax(teacher, dim=-1)
    s = torch.log_softmax(student, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def check_disjoint(train_items, eval_paths: Sequence[str | Path]) -> None:
    """Refuse a training set that shares an item (its question, or any chunk text) with an
    evaluation set: figures measured on such a set would measure memory, not the method."""
    seen_q = {it.question.strip(): it.id for it in train_items}
    seen_c = {c.strip(): it.id for it in train_items for c in it.chunks}
    problems = []
    for path in eval_paths:
        report = load_items(path)
        for it in report.items:
            hit = seen_q.get(it.question.strip()) or next(
                (seen_c[c.strip()] for c in it.chunks if c.strip() in seen_c), None)
            if hit:
                problems.append(f"{it.id} ({Path(path).name}) ~ {hit}")
    if problems:
        raise ValueError(f"the training set shares {len(problems)} item(s) with the evaluation "
                         f"set(s): {', '.join(problems[:20])}"
                         + (" …" if len(problems) > 20 else "")
                         + ". Remove them from the training data.")


def training_contexts(tok, chunks: Sequence[str], pool: Sequence[str], context_tokens: int,
                      rng: random.Random) -> list[list[int]]:
    """The context each chunk of a training item is encoded after, as `context_token_ids` builds
    it at ingestion (at most `context_tokens` tokens; the first chunk of a document has none).
    `pool`: the training set's paragraphs, stripped.

    Training items are retrieved paragraphs, not documents, so the document around each chunk is
    made up, in one of two ways per item, half the time each: the item's chunks are one
    document's pieces in prompt order (each chunk after the ones before it, as when a prompt
    holds a document's sections in order), or each chunk is a piece of its own document whose
    text before it is 0–4 paragraphs of other items (as when retrieval mixes documents and the
    text before a chunk is not in the prompt)."""
    own = {c.strip() for c in chunks}
    others = [p for p in pool if p not in own]
    out = []
    ordered = rng.random() < 0.5 or not others
    for i, chunk in enumerate(chunks):
        if ordered:
            before = CONTEXT_JOIN.join(c.strip() for c in chunks[:i])
        else:
            before = CONTEXT_JOIN.join(rng.sample(others, min(len(others), rng.randint(0, 4))))
        out.append(context_token_ids(tok, before, context_tokens, chunk))
    return out


def build_examples(tok, items, anchor: Sequence[int], pad_id: int, cfg: DistillConfig,
                   max_tokens: int) -> list[DistillExample]:
    """The items' examples under `cfg` (its soft tokens, min_chunks, context_tokens and seed);
    `max_tokens` bounds the stitched prompt without its contexts (their tokens are hidden and
    add only to the cost of a step). Contexts are always made up (`training_contexts`): an
    item's own `contexts`, which evaluation reads, are not used."""
    num_soft, min_chunks, context_tokens = cfg.soft_tokens, cfg.min_chunks, cfg.context_tokens
    rng = random.Random(cfg.seed)
    pool = sorted({c.strip() for it in items for c in it.chunks}) if context_tokens else []
    out = []
    for it in items:
        if len(it.chunks) < min_chunks:
            continue
        name = it.template or "eval"
        rendered = render(name, tok, it.question, it.chunks, target_reply(it, name))
        contexts = training_contexts(tok, rendered.chunk_texts, pool, context_tokens, rng) \
            if context_tokens else None
        ex = make_example(tok, rendered.prompt, rendered.chunk_texts, rendered.completion,
                          anchor, num_soft, pad_id, contexts)
        if len(ex.ids) - ex.context_len <= max_tokens and ex.reply:
            out.append(ex)
    return out


def _save(enc: LearnedEncoding, cfg: DistillConfig, base_model: str, steps: int,
          path: Path) -> None:
    enc.meta = {"base_model": base_model, "steps": steps, "lr": cfg.lr,
                "soft_tokens": cfg.soft_tokens, "lora_rank": cfg.lora_rank, "seed": cfg.seed,
                "ce_weight": cfg.ce_weight, "data": Path(cfg.data).name,
                "context_tokens": cfg.context_tokens,
                "objective": "KL(full prefill || stitched) over the reply"}
    if cfg.init:
        enc.meta["continued_from"] = Path(cfg.init).name
    enc.save(path)


def _continue_from(cfg: DistillConfig, fp) -> LearnedEncoding:
    """The encoder in cfg.init, made trainable, after checking it fits this run: same model,
    tokenizer and anchor, and the shape the options ask for (a silent reshape would be a new
    encoder under an old name)."""
    enc = LearnedEncoding.load(cfg.init)
    enc.check_model(fp.weights, fp.tokenizer, cfg.anchor)
    soft = 0 if enc.soft is None else enc.soft.shape[0]
    rank = next(iter(enc.lora.values()))[0].shape[0] if enc.lora else 0
    if (soft, rank) != (cfg.soft_tokens, cfg.lora_rank):
        raise ValueError(f"--init {cfg.init} has {soft} soft tokens and LoRA rank {rank}; this "
                         f"run asks for {cfg.soft_tokens} and {cfg.lora_rank}: pass the same")
    if enc.soft is not None:
        enc.soft = enc.soft.detach().float().clone().requires_grad_()
    enc.lora = {name: (a.detach().float().clone().requires_grad_(),
                       b.detach().float().clone().requires_grad_(), scale)
                for name, (a, b, scale) in enc.lora.items()}
    return enc


def distill(cfg: DistillConfig, *, loaded=None, eval_sets: Sequence[str | Path] = (),
            log: Callable[[str], None] = print) -> dict:
    """Train and save `encoder.safetensors` in cfg.out; returns a summary."""
    if cfg.soft_tokens < 0 or cfg.lora_rank < 0 or not (cfg.soft_tokens or cfg.lora_rank):
        raise ValueError("train soft tokens (--soft-tokens N > 0), an encode-only LoRA "
                         "(--lora-rank R > 0), or both")
    if cfg.context_tokens < 0:
        raise ValueError(f"context_tokens must be ≥ 0 (0: chunks alone), not {cfg.context_tokens}")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    report = load_items(cfg.data)
    if report.errors:
        log(f"skipping {len(report.errors)} malformed lines: {report.errors[:3]}")
    if not report.items:
        raise ValueError(f"no training items in {cfg.data}")
    check_disjoint(report.items, eval_sets)
    loaded = loaded or load_model(cfg.model, progress=False)
    model, tok = loaded.model, loaded.tokenizer
    model.eval()  # no dropout: the student must be the inference forward
    for p in model.parameters():
        p.requires_grad_(False)
    fp = fingerprint_model(model, tok, loaded.name)
    anchor = anchor_ids(cfg.anchor, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    examples = build_examples(tok, report.items, anchor, pad, cfg,
                              min(cfg.max_tokens, loaded.context_window))
    if not examples:
        raise ValueError("no training example fits --max-tokens")
    lengths = sorted(len(e.ids) for e in examples)
    log(f"{len(examples)} examples, median {lengths[len(lengths) // 2]} tokens"
        + (" (contexts included)" if cfg.context_tokens else ""))

    prior = 0  # steps already in the encoder continued from
    if cfg.init:
        enc = _continue_from(cfg, fp)
        soft, lora = enc.soft, enc.lora
        prior = int(enc.meta.get("steps", 0))
    else:
        soft = None
        if cfg.soft_tokens:
            # start from the embeddings of real tokens (the anchor's last tokens, repeated): a
            # neutral point the model already reads, so step 0 is the training-free encoding
            table = model.get_input_embeddings().weight.detach().float()
            seed_ids = (anchor or [pad])[-cfg.soft_tokens:]
            seed_ids = (seed_ids * cfg.soft_tokens)[:cfg.soft_tokens]
            soft = table[seed_ids].clone().requires_grad_()
        lora = new_lora(model, cfg.lora_rank, seed=cfg.seed) if cfg.lora_rank else {}
        enc = LearnedEncoding(soft=soft, lora=lora, base_weights=fp.weights,
                              tokenizer=fp.tokenizer, anchor=cfg.anchor)
    params = ([soft] if soft is not None else []) + [t for a, b, _ in lora.values() for t in (a, b)]
    opt, sched = optim.optimizer(params, cfg.lr, cfg.warmup, cfg.steps)
    order: list[int] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        if not order:
            order = rng.sample(range(len(examples)), len(examples))
        ex = examples[order.pop()]
        teacher = teacher_logits(model, ex)
        student = student_logits(model, enc, ex)
        loss = kl_loss(teacher, student)
        if cfg.ce_weight:
            target = torch.tensor(ex.reply, device=student.device)
            loss = loss + cfg.ce_weight * torch.nn.functional.cross_entropy(student, target)
        losses.append(optim.step(loss, params, opt, sched))
        optim.report(log, step + 1, cfg.steps, losses, t0, "KL")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            _save(enc, cfg, loaded.name, prior + step + 1,
                  Path(cfg.out) / f"encoder-{prior + step + 1}.safetensors")
    out = Path(cfg.out)
    _save(enc, cfg, loaded.name, prior + cfg.steps, out / ENCODER_FILE)
    summary = {"steps": cfg.steps, "examples": len(examples), "first_loss": losses[0],
               "final_loss": sum(losses[-10:]) / len(losses[-10:]),
               "train_s": time.perf_counter() - t0, "config": asdict(cfg),
               "encoder": str(out / ENCODER_FILE)}
    (out / META_FILE).write_text(json.dumps(summary, indent=2))
    return summary
