"""Fine-tuning examples in TurboRAG's layout: independent-attention mask, stitched positions.

An example is laid out exactly as the engine lays out the prompt at inference (the same prompt
text, cut around the chunk texts in its own tokenization by `segment.token_pieces`), followed by
the answer. The sequence and mask are `stitch.layout`'s (invariant 2): chunk tokens
see only their own chunk — and their own copy of the anchor the engine encodes chunks after,
which nothing else sees — and every other token (template, question, answer) sees all prompt
tokens before it. Position ids are reordered (each token at its prompt index) or composite (each
chunk from its encoding position). The loss covers the answer tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.prefill.segment import (Piece, is_separator, split_prompt, token_pieces,
                                    tokenize_with_starts)
from ..core.prefill.separators import separator_ids
from ..core.prefill.stitch import Segment, independent_attention_mask, layout, plan_prompt
from ..evaluation.prompt import DOC_END, DOC_START, build_prompt, render

IGNORE = -100


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


@dataclass
class Example:
    input_ids: list[int]
    position_ids: list[int]
    # (start, length, hidden) of each independently attended span; its first `hidden` tokens are
    # the anchor copy that only the span sees
    chunk_spans: list[tuple[int, ...]]
    labels: list[int]  # IGNORE except on answer tokens
    prompt_len: int  # sequence length before the answer (anchor copies included)
    prompt_index: list[int] = None  # where each prompt token sits in the sequence

    def __post_init__(self):
        if self.prompt_index is None:
            self.prompt_index = list(range(self.prompt_len))

    def mask(self) -> torch.Tensor:
        return independent_attention_mask(len(self.input_ids), self.chunk_spans)


def add_doc_tokens(tokenizer, model=None) -> list[int]:
    """Add <|doc_start|>/<|doc_end|> as special tokens (and resize the model's embeddings)."""
    tokenizer.add_special_tokens({"additional_special_tokens": [DOC_START, DOC_END]},
                                 replace_extra_special_tokens=False) \
        if _accepts_replace(tokenizer) else \
        tokenizer.add_special_tokens({"additional_special_tokens": [DOC_START, DOC_END]})
    if model is not None and model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    return tokenizer.convert_tokens_to_ids([DOC_START, DOC_END])


def _accepts_replace(tokenizer) -> bool:
    import inspect

    return "replace_extra_special_tokens" in inspect.signature(tokenizer.add_special_tokens).parameters


def prompt_segments(tokenizer, prompt: str, chunk_texts: Sequence[str],
                    cache_prefix: bool = True, anchor_len: int = 0) -> list[Segment]:
    """The engine's segmentation of `prompt` (see TurboRAGEngine.segments), with token-only blobs:
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
        # a stock separator between two chunks is encoded like a chunk (engine.segments)
        is_chunk = piece.chunk is not None or is_separator(pieces, i, separators)
        cached = is_chunk or (i == 0 and cache_prefix and any(p.chunk for p in pieces[1:]))
        blob = _TokensOnly(piece.ids, anchor_len if is_chunk else 0, not is_chunk) \
            if cached else None
        segments.append(Segment(piece.text, blob, None if cached else piece.ids))  # type: ignore[arg-type]
    return segments


def completion_text(tokenizer, prompt: str, messages_answer: str, question: str,
                    chunks: Sequence[str], doc_tokens: bool) -> str:
    """What the chat template puts after the generation prompt for an assistant reply."""
    from ..evaluation.prompt import SEPARATOR, SYSTEM, wrap_chunks

    texts = wrap_chunks(chunks, doc_tokens)
    user = "Context:\n" + SEPARATOR.join(texts) + f"{SEPARATOR}Question: {question}"
    full = render(tokenizer, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": user},
                              {"role": "assistant", "content": messages_answer}],
                  add_generation_prompt=False)
    if full.startswith(prompt):
        return full[len(prompt):]
    eos = tokenizer.eos_token or ""
    return messages_answer + eos


def build_example(tokenizer, question: str, chunks: Sequence[str], answer: str, *,
                  positions: str = "reordered", doc_tokens: bool = False,
                  cache_prefix: bool = True, anchor_ids: Sequence[int] = ()) -> Example:
    """An example on the evaluation prompt (optionally with document tokens)."""
    prompt, texts = build_prompt(tokenizer, question, chunks, doc_tokens=doc_tokens)
    tail = completion_text(tokenizer, prompt, answer, question, chunks, doc_tokens)
    return example_from_prompt(tokenizer, prompt, texts, tail, positions=positions,
                               cache_prefix=cache_prefix, anchor_ids=anchor_ids)


def example_from_prompt(tokenizer, prompt: str, chunk_texts: Sequence[str], completion: str, *,
                        positions: str = "reordered", cache_prefix: bool = True,
                        anchor_ids: Sequence[int] = ()) -> Example:
    """An example from any rendered prompt (training/templates.py), its chunk texts as they occur
    in it, and the completion text to learn."""
    segments = prompt_segments(tokenizer, prompt, chunk_texts, cache_prefix, len(anchor_ids))
    plan = plan_prompt(segments, tokenizer, positions=positions)
    lay = layout(plan, anchor_ids)
    ans = tokenizer(completion, add_special_tokens=False)["input_ids"]
    # the answer continues where generation does, in the layout's shifted positions
    start = plan.next_position + len(anchor_ids)
    ids = lay.token_ids + ans
    pos = lay.positions + list(range(start, start + len(ans)))
    labels = [IGNORE] * len(lay.token_ids) + ans
    return Example(ids, pos, lay.spans, labels, len(lay.token_ids), lay.prompt_index)


class TurboRAGCollator:
    """Batches examples: right padding, a [B, 1, T, T] additive mask, position ids, labels."""

    def __init__(self, pad_token_id: int = 0, dtype: torch.dtype = torch.float32):
        self.pad = pad_token_id
        self.dtype = dtype

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        T = max(len(e.input_ids) for e in examples)
        B = len(examples)
        ids = torch.full((B, T), self.pad, dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        allowed = torch.zeros((B, 1, T, T), dtype=torch.bool)
        for b, e in enumerate(examples):
            n = len(e.input_ids)
            ids[b, :n] = torch.tensor(e.input_ids)
            pos[b, :n] = torch.tensor(e.position_ids)
            labels[b, :n] = torch.tensor(e.labels)
            allowed[b, 0, :n, :n] = e.mask()
            idx = torch.arange(n, T)
            allowed[b, 0, idx, idx] = True  # padding rows see themselves only (no NaN rows)
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min)
        return {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "labels": labels}


def answer_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens; the LM head runs on those positions only."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = base.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=batch["attention_mask"], use_cache=False)
    hidden = out.last_hidden_state[:, :-1]
    target = batch["labels"][:, 1:]
    keep = target != IGNORE
    logits = base.lm_head(hidden[keep]).float()
    return torch.nn.functional.cross_entropy(logits, target[keep])


def forward_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T, vocab] logits of the training forward (for checks against the inference path)."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits.float()
