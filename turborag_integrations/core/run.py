"""One streamed generation, from the call to its result: the lifecycle every engine shares.

An engine prefills its prompt and hands over a `Run`: batches of new token ids (one per decode
step, or one per speculative round), the stats it has filled so far, and what to do when the
run ends. `GenerationStream` turns that into text deltas, stops at stop strings, and however
the run ends — all tokens, a stop, an exception, or a consumer that closes the stream early —
calls the run's `finish` once (release pooled caches, store what is worth keeping), fills in the
timing, and sets `.result`.

    stream = engine.stream(prompt, chunks=chunks)
    for delta in stream: ...
    stream.result.stats.ttft_s
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

from .decode.loop import TextDeltas, now


@dataclass
class RunStats:
    """What every generation measures. ttft_s runs from the call to the first token."""

    ttft_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0
    finish_reason: str = ""  # "stop" (end of sequence or a stop string), "length", "cancelled"

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes from the prefill; the rest cost one step each
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


@dataclass
class GenerationStats(RunStats):
    """What one TurboRAG call cost: assembly (finding, loading, re-rotating blobs) and prefill
    of the rest, then decoding."""

    mode: str = "turbo"
    assembly_s: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(d.pop("extra"))
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: RunStats


@dataclass
class Run:
    """What an engine hands the lifecycle once its prompt is prefilled."""

    tokens: Iterator[int | Sequence[int]]  # new token ids, one by one or in batches
    stats: RunStats
    limit: int  # most new tokens; ending earlier without a stop string means end of sequence
    tokenizer: object
    stop: Sequence[str] = ()
    finish: Callable[[], None] = lambda: None  # called once, however the run ends


class GenerationStream:
    """Iterate for text deltas; `.result` is filled in once the iteration ends (also when the
    consumer closes it early: the stats of a partial answer are kept)."""

    def __init__(self, deltas: Iterator[str] | None = None, *,
                 start: Callable[[], Run] | None = None):
        """start: prefills and returns the Run; called on the first iteration, so that errors
        (and the time to first token) belong to the consumer's loop, not to this constructor."""
        self.result: GenerationResult | None = None
        self._deltas = self._lifecycle(start) if start is not None else iter(deltas or ())

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def close(self) -> None:
        """Stop generating now; the pooled caches are released and `.result` is filled in."""
        close = getattr(self._deltas, "close", None)
        if close is not None:
            close()

    def _lifecycle(self, start: Callable[[], Run]) -> Iterator[str]:
        t0 = now()
        run = start()
        stats = run.stats
        deltas = TextDeltas(run.tokenizer, run.stop)
        t_first = None
        finish = "length"
        try:
            for batch in run.tokens:
                if isinstance(batch, int):
                    batch = (batch,)
                if t_first is None:
                    t_first = now()
                    stats.ttft_s = t_first - t0
                for token in batch:
                    delta = deltas.push(token)
                    if delta:
                        yield delta
                    if deltas.stopped:
                        break
                if deltas.stopped:
                    finish = "stop"
                    break
            else:
                if len(deltas.ids) < run.limit:
                    finish = "stop"  # end-of-sequence token
        except GeneratorExit:
            finish = "cancelled"
            raise
        finally:
            close = getattr(run.tokens, "close", None)
            if close is not None:
                close()
            t_end = now()
            run.finish()
            if t_first is None:
                stats.ttft_s = t_end - t0
            stats.new_tokens = len(deltas.ids)
            stats.decode_s = t_end - t_first if t_first is not None else 0.0
            stats.finish_reason = finish
            self.result = GenerationResult(text=deltas.text, token_ids=list(deltas.ids),
                                           stats=stats)
        tail = deltas.flush()
        if tail:
            yield tail
