"""The decoding loop: sampling, stop strings, streaming text deltas, per-call stats."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch

from .decode import QUANTIZE_MODES, FastDecoder, stock_step
from .selfspec import DraftStats, drafter_for, speculative_decode

log = logging.getLogger(__name__)

DRAFT_MODES = (None, "int8", "bf16")

@dataclass
class GenerationConfig:
    """How to pick tokens. temperature 0 means greedy (the default).

    quantize="int8" decodes with int8 dynamic-quantised copies of the Linear layers (CPU, float32
    llama-family models; prefill stays full precision): about 1.8x faster steps, but greedy
    answers drift from full precision on small models (see core/decode.py); "bf16" keeps answers
    close and, on CPUs with native bf16 (AVX512-BF16), steps about 1.5x faster. None (default)
    keeps the model's weights.

    draft="int8" (or "bf16") keeps the answers of full precision and still decodes faster: a
    quantised copy drafts `draft_tokens` tokens, the model verifies them in one forward and keeps
    what it agrees with (self-speculative decoding, core/selfspec.py). Greedy output equals the
    full-precision output up to the rounding of a multi-token forward; sampling follows the
    model's own distribution. Same model requirements as quantize; falls back to plain decoding
    (with a warning) where the quantised copy cannot be built.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    quantize: str | None = None
    draft: str | None = None
    draft_tokens: int = 4

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be ≥ 0")
        if self.temperature < 0:
            raise ValueError("temperature must be ≥ 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be ≥ 0 (0 = no limit)")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, not {self.quantize!r}")
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"draft must be one of {DRAFT_MODES}, not {self.draft!r}")
        if self.draft and self.quantize:
            raise ValueError("choose draft (quantised drafts, full-precision answers) or quantize "
                             "(quantised answers), not both")
        if self.draft_tokens < 1:
            raise ValueError("draft_tokens must be ≥ 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_logits(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Logits after temperature, top-k and top-p, in the order transformers applies them."""
    logits = logits.float() / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop tokens once the mass before them already reaches top_p (always keep the first)
        drop = cumulative - sorted_logits.softmax(-1) >= config.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


class Sampler:
    def __init__(self, config: GenerationConfig):
        self.config = config
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_logits(logits, self.config).softmax(-1)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.config.greedy:
            return int(logits.argmax(-1))
        probs = self.probs(logits).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextDeltas:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Text is re-decoded as a whole (tokens do not map to characters one to one: byte-level BPE can
    split a character across tokens), and held back while it ends in an incomplete character or
    in what could be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            idx = text.find(s, max(0, self.emitted - len(s)))
            if idx != -1:
                self.text = text[:idx]
                self.stopped = True
                return self._emit(len(self.text))
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):
            safe -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._emit(safe)

    def flush(self) -> str:
        return "" if self.stopped else self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta


@dataclass
class GenerationStats:
    """What one call cost. ttft_s runs from the call to the first token, assembly included."""

    mode: str = "turbo"
    ttft_s: float = 0.0
    assembly_s: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    new_tokens: int = 0
    decode_s: float = 0.0
    finish_reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes from the prefill; the rest cost one step each
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


def step_function(model, quantize: str | None = None, fast: bool = True):
    """A function (token, position, cache) -> next-token logits [vocab] for one decode step.

    The fast path (`decode.FastDecoder`) for supported models, else the model's own forward;
    quantisation needs the fast path and falls back to full precision (with a warning)
    where it cannot run.
    """
    if fast:
        try:
            decoder = FastDecoder.for_model(model, quantize)
        except (ValueError, RuntimeError) as e:
            if quantize is None:
                raise
            log.warning("%s decoding unavailable (%s); decoding in full precision", quantize, e)
            decoder = FastDecoder.for_model(model)
        if decoder is not None:
            return decoder.step
    if quantize is not None:
        log.warning("%s decoding needs the fast decode path; decoding in full precision", quantize)
    return lambda token, position, cache: stock_step(model, token, position, cache)


def decode_loop(model, cache, logits: torch.Tensor, position: int, config: GenerationConfig,
                eos_ids: set[int], max_new_tokens: int | None = None, *,
                fast: bool = True, draft_stats: DraftStats | None = None) -> Iterator[int]:
    """Yield new token ids; the cache grows by each token as it is fed back.

    The token is yielded before its forward step, so a consumer that stops early never pays
    for a step it does not use. fast=False runs every step through the model's stock forward
    (the reference the fast path is tested against).
    """
    sampler = Sampler(config)
    limit = config.max_new_tokens if max_new_tokens is None else max_new_tokens
    if config.draft and fast and limit > 1:
        drafter = drafter_for(model, config.draft)
        if drafter is not None:
            yield from speculative_decode(model, drafter, cache, logits, position, config,
                                          eos_ids, limit, sampler, draft_stats)
            return
        log.warning("%s drafting unavailable for this model; decoding without drafts", config.draft)
    step = step_function(model, config.quantize, fast) if limit > 1 else None
    for i in range(limit):
        token = sampler(logits)
        if token in eos_ids:
            return
        yield token
        if i == limit - 1:
            return
        with torch.inference_mode():
            logits = step(token, position, cache)
        position += 1


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    return {int(i) for i in ids}


def now() -> float:
    return time.perf_counter()
