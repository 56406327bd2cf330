"""Prompt segments → one KV cache: cached chunks stitched in, everything else prefilled once.

A prompt is a list of segments in prompt order: plain text (system prefix, template glue, the
question) or cached chunks (text plus its KV blob). TurboRAG's attention pattern is:

- a cached chunk attends only to itself (it was encoded alone: "independent attention");
- every other token attends causally to all tokens before it in the prompt, chunks included.

Because chunks never look outside themselves, their KV does not depend on where the plain text
falls, so all plain tokens can be prefilled in a single forward after every chunk is in the cache,
with a 4D mask that lets each plain token see exactly the prompt tokens before it. The cache then
holds the chunks first and the plain tokens after them; attention does not care about the order of
cache entries (each key carries its position in its rotation), so decoding simply appends.

Positions: every token sits at its index in the prompt (the paper's "reordered" positions); a
chunk's keys are re-rotated from where they were encoded to start..start+n−1. (The paper's other
choice, every chunk at 0..n−1, answered worse on every set measured and was removed.)

On CPU the masked prefill runs under `core.attention.sdpa_gqa`: grouped-query SDPA instead of
one copy of every key/value head per query head, for this forward only.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..attention import sdpa_gqa, stitched_causal
from ..kv.blob import Fingerprint, KVBlob
from ..kv.cache import CachePool, KVCache
from ..errors import ContextWindowError
from .rope import KeyRotator
from ..transformers_api import with_cache

@dataclass(frozen=True)
class Segment:
    """A piece of the prompt: plain text, or a chunk with its KV blob. A plain segment may
    carry its token ids (`ids`: the prompt's own tokens for this text, segment.token_pieces);
    otherwise its text is tokenized alone."""

    text: str
    blob: KVBlob | None = None
    ids: tuple[int, ...] | None = None

    @property
    def cached(self) -> bool:
        return self.blob is not None


@dataclass
class CachedSpan:
    blob: KVBlob
    prompt_start: int  # index of its first token in the prompt, which is its RoPE position
    # the prompt position of its blob's token 0: prompt_start, except in a run split off a span
    # by a recovery, which keeps its blob's (core/prefill/recovery.py)
    position_start: int


@dataclass
class StitchPlan:
    """Everything about a stitched prompt except the tensors of the chunks."""

    token_ids: list[int]  # the whole prompt in order: the concatenation of the segments' tokens
    positions: list[int]  # RoPE position of each prompt token
    spans: list[CachedSpan]
    plain_index: list[int]  # prompt indices of the tokens to prefill, in order
    next_position: int  # where generation continues

    @property
    def reused_tokens(self) -> int:
        return sum(s.blob.num_tokens for s in self.spans)

    @property
    def prefilled_tokens(self) -> int:
        return len(self.plain_index)


def plan_prompt(segments: Sequence[Segment], tokenizer, *,
                fingerprint: Fingerprint | None = None, context_window: int | None = None,
                reserve: int = 0) -> StitchPlan:
    """Tokenize plain segments, lay out every token's position, and check the window.

    `reserve` tokens (the planned generation) must also fit in `context_window`.
    """
    segments = list(segments)
    # The last token's logits start generation, so the prompt must end with prefilled text; a
    # trailing chunk is simply prefilled (correct, just not reused).
    if segments and segments[-1].cached:
        last = segments[-1]
        segments[-1] = Segment(last.text, ids=tuple(last.blob.token_ids.tolist()))
    token_ids: list[int] = []
    pos: list[int] = []
    spans: list[CachedSpan] = []
    plain_index: list[int] = []
    next_pos = 0
    for seg in segments:
        if seg.cached:
            if fingerprint is not None:
                fingerprint.check_matches(seg.blob.fingerprint)
            ids = seg.blob.token_ids.tolist()
            spans.append(CachedSpan(seg.blob, len(token_ids), next_pos))
            pos.extend(range(next_pos, next_pos + len(ids)))
            next_pos += len(ids)
        else:
            if seg.ids is not None:
                ids = list(seg.ids)
            elif seg.text:
                ids = tokenizer(seg.text, add_special_tokens=False)["input_ids"]
            else:
                continue
            if not ids:
                continue
            plain_index.extend(range(len(token_ids), len(token_ids) + len(ids)))
            pos.extend(range(next_pos, next_pos + len(ids)))
            next_pos += len(ids)
        token_ids.extend(ids)
    if not plain_index:
        raise ValueError("the prompt has no text to prefill: give at least a question")
    if context_window is not None and next_pos + reserve > context_window:
        raise ContextWindowError(
            f"prompt needs {next_pos} positions plus {reserve} for generation, more than the "
            f"model's context window of {context_window}; retrieve fewer or smaller chunks, or "
            "lower max_new_tokens")
    return StitchPlan(token_ids, pos, spans, plain_index, next_pos)


@dataclass
class Prefill:
    """The result of a stitched prefill: a cache ready for decoding and the next-token logits."""

    cache: KVCache
    logits: torch.Tensor  # [vocab] float32, the last prompt token's
    next_position: int
    plan: StitchPlan
    timings: dict = field(default_factory=dict)


def assemble(model, plan: StitchPlan, rotator: KeyRotator, capacity: int,
             pool: CachePool | None = None) -> KVCache:
    """Write every cached chunk into an empty cache, keys rotated to their positions."""
    cache = pool.acquire(model, capacity) if pool is not None else KVCache.empty(model, capacity)
    dtype, device = cache.dtype, cache.device
    for span in plan.spans:
        # Blobs may be stored in another dtype (int8 decodes to float) or come from host memory
        # for a model on an accelerator: cast and move first (no-ops otherwise), so that the
        # rotation runs where the cache lives.
        keys = span.blob.keys.to(device=device, dtype=dtype)
        k_slot, v_slot = cache.slot(span.blob.num_tokens)
        # The keys carry the rotation of the position they were encoded at (after an anchor,
        # base_position > 0); move them from there to their place in this prompt.
        rotator.rotate(keys, span.position_start - span.blob.base_position, out=k_slot[:, 0])
        v_slot[:, 0].copy_(span.blob.values)
    return cache


def plain_mask(plan: StitchPlan, dtype: torch.dtype, boolean: bool) -> torch.Tensor | None:
    """[1, 1, plain, cached + plain] mask: plain token i sees prompt tokens at indices ≤ i.

    None when the plain tokens come after every chunk and in one run: then the stock causal
    mask is already exact, and SDPA can take its faster causal path.
    """
    cached_idx = [i for s in plan.spans for i in range(s.prompt_start, s.prompt_start + s.blob.num_tokens)]
    plain = plan.plain_index
    if not cached_idx and plain == list(range(len(plain))):
        return None
    if cached_idx and plain[0] > cached_idx[-1] and plain == list(range(plain[0], plain[0] + len(plain))) \
            and cached_idx == list(range(len(cached_idx))):
        return None
    keys = torch.tensor(cached_idx + plain)
    queries = torch.tensor(plain)
    allowed = keys[None, :] <= queries[:, None]
    if boolean:
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def prefill(model, plan: StitchPlan, rotator: KeyRotator, *, extra_capacity: int = 256,
            all_logits: bool = False, pool: CachePool | None = None,
            recovery=None) -> Prefill:
    """Assemble the chunks and prefill the plain tokens in one forward.

    all_logits keeps the logits of every plain token ([plain, vocab]) instead of the last one.
    recovery (a `recovery.Recovery`, optional) first moves some chunk tokens into the plain
    tokens, to be recomputed with attention to everything before them; the returned plan is the
    rewritten one.
    """
    rotator.check_length(plan.next_position + extra_capacity)
    t_r = time.perf_counter()
    reused = plan.reused_tokens
    if recovery is not None:
        plan = recovery.apply(model, plan, rotator, pool=pool)
    t0 = time.perf_counter()
    cache = assemble(model, plan, rotator, len(plan.token_ids) + extra_capacity, pool)
    t1 = time.perf_counter()
    logits = run_plain(model, plan, cache, all_logits=all_logits)
    t2 = time.perf_counter()
    return Prefill(cache=cache, logits=logits, next_position=plan.next_position,
                   plan=plan, timings={"assembly_s": t1 - t0, "prefill_s": t2 - t1,
                                       "recovery_s": t0 - t_r,
                                       "recomputed_tokens": reused - plan.reused_tokens})


def run_plain(model, plan: StitchPlan, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
    """Prefill `plan`'s plain tokens in one forward over `cache`, which holds its chunks
    (`assemble`): the last plain token's logits [vocab], or every plain token's [plain, vocab]."""
    device = next(model.parameters()).device
    ids = torch.tensor([[plan.token_ids[i] for i in plan.plain_index]], device=device)
    position_ids = torch.tensor([[plan.positions[i] for i in plan.plain_index]], device=device)
    boolean = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
    mask = plain_mask(plan, next(model.parameters()).dtype, boolean)
    # The mask is two prefixes per row (attention.stitched_causal): attend block by block over
    # only what each block sees, instead of every plain token over the whole cache.
    blocked = stitched_causal(visible_cached(plan), device) if mask is not None \
        else contextlib.nullcontext()
    with torch.inference_mode(), sdpa_gqa(device), blocked:
        out = model(input_ids=ids, position_ids=position_ids, **with_cache(cache),
                    attention_mask=None if mask is None else mask.to(device),
                    use_cache=True, logits_to_keep=0 if all_logits else 1)
    return out.logits[0].float() if all_logits else out.logits[0, -1].float()


def visible_cached(plan: StitchPlan) -> torch.Tensor:
    """For each plain token, how many of the cached entries (in cache order: the spans' tokens,
    in prompt order) come before it in the prompt."""
    cached = torch.tensor([i for s in plan.spans
                           for i in range(s.prompt_start, s.prompt_start + s.blob.num_tokens)],
                          dtype=torch.long)
    return torch.searchsorted(cached, torch.tensor(plan.plain_index, dtype=torch.long))


@dataclass
class Layout:
    """A stitched prompt written out as one sequence for a single masked forward.

    Each anchored chunk is preceded by its own copy of the anchor, which only that chunk sees;
    `spans` are (start, length, hidden) with the anchor copy counted in `length` and `hidden`.
    `prompt_index[i]` is where prompt token i sits in the sequence. Positions are shifted by the
    anchor length so that no anchor copy gets a negative position (RoPE depends only on
    differences, so the shift changes nothing).
    """

    token_ids: list[int]
    positions: list[int]
    spans: list[tuple[int, int, int]]
    prompt_index: list[int]

    def mask(self) -> torch.Tensor:
        return independent_attention_mask(len(self.token_ids), self.spans)


def layout(plan: StitchPlan, anchor_ids: Sequence[int] = ()) -> Layout:
    """The sequence, positions and spans whose masked forward defines a stitched prompt."""
    a = len(anchor_ids)
    starts = {s.prompt_start: s for s in plan.spans}
    ids: list[int] = []
    pos: list[int] = []
    spans: list[tuple[int, int, int]] = []
    index: list[int] = []
    for i, (tok, p) in enumerate(zip(plan.token_ids, plan.positions)):
        span = starts.get(i)
        if span is not None:
            hidden = span.blob.base_position
            if hidden and hidden != a:
                raise ValueError(f"a blob encoded after a {hidden}-token anchor needs those "
                                 f"anchor ids (got {a})")
            spans.append((len(ids), hidden + span.blob.num_tokens, hidden))
            ids.extend(anchor_ids[:hidden])
            pos.extend(range(p - hidden + a, p + a))
        index.append(len(ids))
        ids.append(tok)
        pos.append(p + a)
    return Layout(ids, pos, spans, index)


def reference_forward(model, plan: StitchPlan, anchor_ids: Sequence[int] = ()) -> torch.Tensor:
    """Logits [prompt, vocab] of one forward over the whole prompt under TurboRAG's attention
    pattern.

    The definition the stitched path must reproduce (invariant 2), written the obvious way: one
    4D mask over the full prompt in which chunk tokens see only their own chunk (and the copy of
    the anchor they were encoded after), causally, and every other token sees all prompt tokens
    before it. Also the layout the chunk encoder is trained on (training/distill.py).
    """
    lay = layout(plan, anchor_ids)
    mask = lay.mask()
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
        ~mask.to(device), torch.finfo(dtype).min)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([lay.token_ids], device=device),
                    position_ids=torch.tensor([lay.positions], device=device),
                    attention_mask=additive[None, None], use_cache=False)
    return out.logits[0, lay.prompt_index].float()


def independent_attention_mask(n: int, chunk_spans: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """[n, n] boolean mask (True = may attend) of TurboRAG's independent attention.

    chunk_spans: (start, length) of each chunk in the sequence, or (start, length, hidden) when
    the span's first `hidden` tokens (an anchor copy) are seen by that span alone.
    """
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    for start, length, *rest in chunk_spans:
        # Tokens of this chunk see nothing before the chunk's own start.
        mask[start:start + length, :start] = False
        hidden = rest[0] if rest else 0
        if hidden:
            mask[start + length:, start:start + hidden] = False
    return mask
