"""Query-time recovery: recompute a few chunk tokens with attention to everything before them.

A stitched chunk was encoded alone, so its tokens never saw the prompt before the chunk: which
value belongs to which subject is decided by attention across chunks, and no per-chunk encoding
can see it. Recovery turns some chunk tokens back into plain tokens: they are prefilled with the
rest of the plain text, attending causally to every prompt token before them (cached chunk
tokens included), at their own position. Every other chunk token keeps its cached KV. The ways
to choose the tokens:

- `QueryAwareRecompute(ratio)` — `select:0.15`, the default: the chunk tokens the question
  attends to most, read from one stitched prefill of the plain tokens (prefill/relevance.py;
  ProphetKV's criterion). `select:auto` picks the count per request from the same attention.
- `BoundaryRecompute(k)` — `boundary:16`: the first k tokens of each chunk (EPIC).
- `SelectiveRecompute(ratio, layer)` — `blend:0.15`: CacheBlend's criterion, the chunk tokens
  whose layer-`layer` values deviate most from a causal pass of the first layers.
- `FirstChunkRecompute(k)` — `first`: the prompt's first chunk, the one chunk whose full-prefill
  KV depends on nothing but the prompt's head.

Each only rewrites the `StitchPlan`: a recomputed token moves from a cached span into
`plain_index`; a span left with a hole is split into runs that hold views of the blob's
tensors. In a split span, `CachedSpan.position_start` is still the offset the run's keys are
rotated by (the position of the blob's token 0), so `stitch.assemble` places every kept token
exactly where it was.

`parse_recovery("select:0.15")`, `"boundary:16"`, `"boundary:8,select:0.1"` (both) or `"none"`
gives the object that `prefill(..., recovery=...)` and the engine take; `parse_recovery(None)`
is None, "not given", which the engine reads as its own default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import torch

from ..kv.blob import KVBlob
from ..settings import DEFAULT_RECOVERY, RECOVERY_HELP  # noqa: F401 (re-exported)
from .relevance import question_attention
from .stitch import CachedSpan, StitchPlan


def _slice_blob(blob: KVBlob, start: int, end: int) -> KVBlob:
    # base_position stays the blob's: a run's keys keep the rotation they were encoded with.
    return replace(blob, token_ids=blob.token_ids[start:end], keys=blob.keys[:, :, start:end],
                   values=blob.values[:, :, start:end])


def recompute_tokens(plan: StitchPlan, indices: Iterable[int]) -> StitchPlan:
    """A plan in which the cached prompt tokens at `indices` are prefilled instead.

    Indices that are already plain are ignored. Token ids, positions and the next position are
    unchanged; only which tokens come from blobs changes.
    """
    chosen = set(int(i) for i in indices)
    if not chosen or not plan.spans:
        return plan
    spans: list[CachedSpan] = []
    moved: list[int] = []
    for span in plan.spans:
        n = span.blob.num_tokens
        local = sorted(i - span.prompt_start for i in chosen
                       if span.prompt_start <= i < span.prompt_start + n)
        if not local:
            spans.append(span)
            continue
        moved.extend(span.prompt_start + j for j in local)
        cuts = [-1] + local + [n]
        for a, b in zip(cuts, cuts[1:]):
            lo, hi = a + 1, b  # keep run [lo, hi)
            if hi > lo:
                spans.append(CachedSpan(_slice_blob(span.blob, lo, hi), span.prompt_start + lo,
                                        span.position_start))
    if not moved:
        return plan
    plain = sorted(set(plan.plain_index) | set(moved))
    return replace(plan, spans=spans, plain_index=plain)


class Recovery:
    """Base: choose which cached tokens to recompute. `apply` returns the rewritten plan.
    The base class itself recomputes nothing: `NO_RECOVERY`, what "none" parses to."""

    name = "none"

    def recomputed_share(self) -> float:
        """About what share of the chunk tokens this recomputes (for the cost rule below)."""
        return 0.0

    def probes(self) -> bool:
        """Whether choosing the tokens runs a forward of the plain tokens first."""
        return False

    def select(self, model, plan: StitchPlan, rotator, pool=None) -> list[int]:
        return []

    def apply(self, model, plan: StitchPlan, rotator, pool=None) -> StitchPlan:
        """`pool`: where a recovery that stitches the prompt to read it takes its cache from."""
        if not plan.spans:
            return plan
        return recompute_tokens(plan, self.select(model, plan, rotator, pool))

    def __str__(self) -> str:
        return self.name


NO_RECOVERY = Recovery()


def _chunk_spans(plan: StitchPlan) -> list[CachedSpan]:
    # The cached prefix (system prompt, template head) at prompt index 0 is exact already: a
    # token at the start of the prompt has nothing before it to miss.
    return [s for s in plan.spans if s.prompt_start > 0]


@dataclass
class BoundaryRecompute(Recovery):
    """Recompute the first k tokens of every chunk."""

    k: int = 16

    def __post_init__(self):
        if self.k < 0:
            raise ValueError("boundary recompute needs k ≥ 0 tokens")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"boundary:{self.k}"

    def select(self, model, plan, rotator, pool=None) -> list[int]:
        return [s.prompt_start + j for s in _chunk_spans(plan)
                for j in range(min(self.k, s.blob.num_tokens))]


@dataclass
class FirstChunkRecompute(Recovery):
    """Recompute the prompt's first chunk (its first k tokens; None: all of them). It follows
    only the prompt's head, which is exact, so recomputed in full it is exactly the full
    prefill's, whatever its blob was encoded after."""

    k: int | None = None

    def __post_init__(self):
        if self.k is not None and self.k < 0:
            raise ValueError("first-chunk recompute needs k ≥ 0 tokens")

    @property
    def name(self) -> str:  # type: ignore[override]
        return "first" if self.k is None else f"first:{self.k}"

    def select(self, model, plan, rotator, pool=None) -> list[int]:
        spans = _chunk_spans(plan)
        if not spans:
            return []
        n = spans[0].blob.num_tokens if self.k is None else min(self.k, spans[0].blob.num_tokens)
        return list(range(spans[0].prompt_start, spans[0].prompt_start + n))


@dataclass
class SelectiveRecompute(Recovery):
    """CacheBlend-style: recompute the chunk tokens whose layer-`layer` values deviate most."""

    ratio: float = 0.15
    layer: int = 1

    def __post_init__(self):
        if not 0 <= self.ratio <= 1:
            raise ValueError("selective recompute ratio must be in [0, 1]")
        if self.layer < 1:
            raise ValueError("selective recompute compares at layer ≥ 1 (layer 0 never deviates)")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"blend:{self.ratio:g}" + (f"@{self.layer}" if self.layer != 1 else "")

    def recomputed_share(self) -> float:
        return self.ratio

    def select(self, model, plan, rotator, pool=None) -> list[int]:
        spans = _chunk_spans(plan)
        cached = sum(s.blob.num_tokens for s in spans)
        budget = math.ceil(self.ratio * cached)
        if budget == 0:
            return []
        deviation = value_deviation(model, plan, self.layer)
        index = torch.cat([torch.arange(s.prompt_start, s.prompt_start + s.blob.num_tokens)
                           for s in spans])
        top = deviation[index].topk(min(budget, len(index))).indices
        return index[top].tolist()


# select:auto — the budget follows the question: the fewest chunk tokens that hold `AUTO_MASS`
# of its attention to the chunks, no fewer than AUTO_LOW and no more than AUTO_HIGH of them.
AUTO_MASS = 0.5
AUTO_LOW = 0.05
AUTO_HIGH = 0.3


@dataclass
class QueryAwareRecompute(Recovery):
    """Recompute the chunk tokens the question attends to most (ProphetKV-style; the score is
    core/prefill/relevance.py's): `ratio` of the chunk tokens, or with `ratio=None` ("auto") the
    fewest that hold `mass` of the question's attention to the chunks, between `low` and
    `high` of them. A prompt gets one extra stitched prefill of its plain tokens (the probe)."""

    ratio: float | None = 0.15
    low: float = AUTO_LOW
    high: float = AUTO_HIGH
    mass: float = AUTO_MASS

    def __post_init__(self):
        if self.ratio is not None and not 0 < self.ratio <= 1:
            raise ValueError(f"select ratio must be in (0, 1], got {self.ratio:g}")
        if not 0 <= self.low <= 1 or not 0 < self.high <= 1:
            raise ValueError(f"select:auto bounds must lie in [0, 1], got {self.low:g}-"
                             f"{self.high:g}")
        if self.high < self.low:
            raise ValueError(f"select:auto cap {self.high:g} is below its floor {self.low:g}")
        if not 0 < self.mass <= 1:
            raise ValueError(f"select:auto attention mass must be in (0, 1], got {self.mass:g}")

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.ratio is not None:
            return f"select:{self.ratio:g}"
        bounds = (self.low, self.high, self.mass) != (AUTO_LOW, AUTO_HIGH, AUTO_MASS)
        return "select:auto" + (f":{self.low:g}-{self.high:g}" if bounds else "")

    def recomputed_share(self) -> float:
        return self.high if self.ratio is None else self.ratio

    def probes(self) -> bool:
        return True

    def budget(self, scores: torch.Tensor) -> int:
        """How many of the chunk tokens with these scores to recompute."""
        n = len(scores)
        if self.ratio is not None:
            return math.ceil(self.ratio * n)
        ordered = scores.sort(descending=True).values.cumsum(0)
        total = float(ordered[-1]) if n else 0.0
        needed = int((ordered < self.mass * total).sum()) + 1 if total > 0 else 0
        return min(max(needed, math.ceil(self.low * n)), math.ceil(self.high * n), n)

    def select(self, model, plan, rotator, pool=None) -> list[int]:
        spans = _chunk_spans(plan)
        if not spans:
            return []
        index = torch.cat([torch.arange(s.prompt_start, s.prompt_start + s.blob.num_tokens)
                           for s in spans])
        if self.ratio is not None and math.ceil(self.ratio * len(index)) >= len(index):
            return index.tolist()  # everything: no need to ask which
        scores = question_attention(model, plan, rotator, pool).scores[index]
        top = scores.topk(self.budget(scores)).indices
        return index[top].tolist()


@dataclass
class Combined(Recovery):
    parts: Sequence[Recovery] = ()

    @property
    def name(self) -> str:  # type: ignore[override]
        return ",".join(p.name for p in self.parts) or "none"

    def recomputed_share(self) -> float:
        return min(1.0, sum(p.recomputed_share() for p in self.parts))

    def probes(self) -> bool:
        return any(p.probes() for p in self.parts)

    def select(self, model, plan, rotator, pool=None) -> list[int]:
        out: set[int] = set()
        for p in self.parts:
            out.update(p.select(model, plan, rotator, pool))
        return sorted(out)


@dataclass
class SparingExact(Recovery):
    """`inner`, less the tokens of spans whose blob `exact(blob)` says is the full prefill's KV
    already (a lead blob): recomputing them would give the same KV and cost their prefill."""

    inner: Recovery
    exact: Callable[[KVBlob], bool]

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def recomputed_share(self) -> float:
        return self.inner.recomputed_share()

    def probes(self) -> bool:
        return self.inner.probes()

    def select(self, model, plan, rotator, pool=None) -> list[int]:
        spared = {i for s in plan.spans if self.exact(s.blob)
                  for i in range(s.prompt_start, s.prompt_start + s.blob.num_tokens)}
        return [i for i in self.inner.select(model, plan, rotator, pool) if i not in spared]


def without_first(recovery: Recovery | None) -> Recovery | None:
    """`recovery` less its first-chunk part, for a prompt whose first chunk is exact already (a
    lead blob, core/library.py): recomputing it would give the same KV and cost its prefill."""
    if isinstance(recovery, FirstChunkRecompute):
        return NO_RECOVERY
    if isinstance(recovery, Combined):
        rest = [p for p in recovery.parts if not isinstance(p, FirstChunkRecompute)]
        return NO_RECOVERY if not rest else rest[0] if len(rest) == 1 else Combined(rest)
    return recovery


def _decoder(model):
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise ValueError(f"selective recompute does not know the layout of {type(model).__name__}")
    return inner


def value_deviation(model, plan: StitchPlan, layer: int = 1) -> torch.Tensor:
    """[prompt] L2 distance between each token's layer-`layer` values under full causal attention
    and the values the stitched cache holds for it (0 for plain tokens).

    Values carry no RoPE, so cached and recomputed values compare directly at any position.
    """
    inner = _decoder(model)
    layer = min(layer, len(inner.layers) - 1)
    device = next(model.parameters()).device
    ids = torch.tensor([plan.token_ids], device=device)
    pos = torch.tensor([plan.positions], device=device)
    with torch.inference_mode():
        h = inner.embed_tokens(ids)
        position_embeddings = inner.rotary_emb(h, pos)
        for block in inner.layers[:layer]:
            out = block(h, attention_mask=None, position_ids=pos,
                        position_embeddings=position_embeddings, use_cache=False)
            h = out[0] if isinstance(out, tuple) else out
        attn = inner.layers[layer].self_attn
        v = attn.v_proj(inner.layers[layer].input_layernorm(h))[0]  # [prompt, heads * dim]
    dev = torch.zeros(len(plan.token_ids), device=device)
    for span in plan.spans:
        cached = span.blob.values[layer].to(device=device, dtype=v.dtype)  # [heads, n, dim]
        cached = cached.transpose(0, 1).reshape(cached.shape[1], -1)
        a, b = span.prompt_start, span.prompt_start + span.blob.num_tokens
        dev[a:b] = (v[a:b] - cached).float().norm(dim=-1)
    return dev.cpu()


def parse_recovery(spec: str | Recovery | None) -> Recovery | None:
    """"none" | "select:ratio" | "select:auto[:low-high]" | "first[:k]" | "boundary[:k]" |
    "blend[:ratio[@layer]]" | several joined by "," → a Recovery ("none": `NO_RECOVERY`);
    None stays None ("not given")."""
    if spec is None or isinstance(spec, Recovery):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a recovery is a spec such as 'select:0.15', not {type(spec).__name__}"
                         f" {spec!r}: use {RECOVERY_HELP}")
    parts: list[Recovery] = []
    for item in (s.strip() for s in str(spec).split(",")):
        if not item or item == "none":
            continue
        name, _, arg = item.partition(":")
        if name not in ("first", "boundary", "select", "blend"):
            raise ValueError(f"unknown recovery {item!r}: use {RECOVERY_HELP}")
        try:
            if name == "first":
                parts.append(FirstChunkRecompute(int(arg) if arg else None))
            elif name == "boundary":
                parts.append(BoundaryRecompute(int(arg) if arg else 16))
            elif name == "select":
                parts.append(_parse_select(arg))
            elif name == "blend":
                ratio, _, layer = arg.partition("@")
                parts.append(SelectiveRecompute(float(ratio) if ratio else 0.15,
                                                int(layer) if layer else 1))
        except ValueError as exc:
            raise ValueError(f"bad recovery {item!r}: use {RECOVERY_HELP}"
                             + (f" ({exc})" if str(exc) else "")) from None
    if not parts:
        return NO_RECOVERY
    return parts[0] if len(parts) == 1 else Combined(parts)


def _parse_select(arg: str) -> QueryAwareRecompute:
    """"0.15" | "auto" | "auto:LOW-HIGH"."""
    if arg.startswith("auto"):
        bounds = arg[len("auto"):]
        if not bounds:
            return QueryAwareRecompute(None)
        low, sep, high = bounds.lstrip(":").partition("-")
        if not bounds.startswith(":") or not sep:
            raise ValueError("select:auto takes its bounds as auto:LOW-HIGH, e.g. auto:0.05-0.3")
        return QueryAwareRecompute(None, low=float(low), high=float(high))
    if not arg:
        raise ValueError("select needs a ratio or auto, e.g. select:0.15")
    return QueryAwareRecompute(float(arg))
