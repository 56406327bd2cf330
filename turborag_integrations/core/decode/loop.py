"""The decode loop: tokens after a prefill, one step (or one drafted round) at a time, and the
text deltas they make, with stop strings."""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

import torch

from ..settings import GenerationConfig
from .fast import FastDecoder, stock_step
from .sampling import Sampler
from .selfspec import DraftStats, drafter_for, speculative_decode
from .start import DecodeStart

log = logging.getLogger(__name__)


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


def step_function(model, quantize: str | None = None, fast: bool = True,
                  matmul: str | None = None):
    """A function (token, position, cache) -> next-token logits [vocab] for one decode step.

    The fast path (`decode.FastDecoder`) for supported models, else the model's own forward;
    quantisation needs the fast path and falls back to full precision (with a warning)
    where it cannot run. matmul: the fast path's products (`FastDecoder.for_model`).
    """
    if fast:
        try:
            decoder = FastDecoder.for_model(model, quantize, matmul)
        except (ValueError, RuntimeError) as e:
            if quantize is None:
                raise
            log.warning("%s decoding unavailable (%s); decoding in full precision", quantize, e)
            decoder = FastDecoder.for_model(model, matmul=matmul)
        if decoder is not None:
            return decoder.step
    if quantize is not None:
        log.warning("%s decoding needs the fast decode path; decoding in full precision", quantize)
    return lambda token, position, cache: stock_step(model, token, position, cache)


def decode_loop(model, start: DecodeStart, config: GenerationConfig, eos_ids: set[int],
                max_new_tokens: int | None = None, *, fast: bool = True,
                draft_stats: DraftStats | None = None,
                matmul: str | None = None) -> Iterator[int]:
    """Yield new token ids from `start` (the prompt's cache, last logits and next position);
    the cache grows by each token as it is fed back.

    The token is yielded before its forward step, so a consumer that stops early never pays
    for a step it does not use. fast=False runs every step through the model's stock forward
    (the reference the fast path is tested against). matmul: the fast path's products
    ("linear", "gemm", "auto"; None: TURBORAG_DECODE_MATMUL, see `FastDecoder.for_model`).
    """
    cache, logits, position = start
    sampler = Sampler(config)
    limit = config.max_new_tokens if max_new_tokens is None else max_new_tokens
    if config.draft and fast and limit > 1:
        drafter = drafter_for(model, config.draft)
        if drafter is not None:
            yield from speculative_decode(model, drafter, start, config, eos_ids, limit,
                                          sampler, draft_stats)
            return
        log.warning("%s drafting unavailable for this model; decoding without drafts", config.draft)
    step = step_function(model, config.quantize, fast, matmul) if limit > 1 else None
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
