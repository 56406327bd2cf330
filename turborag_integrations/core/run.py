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

What a run has become as its token ids arrive (its text so far, the deltas it owes, its timing)
is a `RunProgress`, kept apart from the iteration: the stream pulls ids and pushes them into
one, and so does a consumer that is handed ids instead (the server's output loop, which gets
them from the batch scheduler's worker; server/outputs.py).
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


class RunProgress:
    """One run's state as its new token ids arrive: its text (stop strings applied, characters
    never split; `TextDeltas`), its timing, and at the end its result.

    `started` is when the run was asked for: the time to first token runs from there to the
    first `arrived()`. Feed it on one thread (or one event loop); it takes no lock."""

    def __init__(self, stats: RunStats, tokenizer, stop: Sequence[str] = (), *,
                 limit: int | None = None, started: float | None = None):
        self.stats = stats
        self.limit = limit  # most new tokens: ending earlier without a stop string means EOS
        self.started = now() if started is None else started
        self.first_at: float | None = None
        self._deltas = TextDeltas(tokenizer, stop)

    @property
    def stopped(self) -> bool:
        """A stop string has been found: the text ends before it, and later ids add nothing."""
        return self._deltas.stopped

    @property
    def token_ids(self) -> list[int]:
        return self._deltas.ids

    def arrived(self) -> None:
        """Note that ids have arrived (the first time: the time to first token)."""
        if self.first_at is None:
            self.first_at = now()
            self.stats.ttft_s = self.first_at - self.started

    def push(self, token: int) -> str:
        """The text `token` adds that is safe to hand out now (text that may still turn out to
        be a stop string or part of a character waits); nothing once stopped."""
        self.arrived()
        return "" if self.stopped else self._deltas.push(token)

    def natural_reason(self) -> str:
        """Why the run ended, when its ids ran out by themselves: a stop string or an
        end-of-sequence token ("stop"), or its token limit ("length")."""
        if self.stopped or (self.limit is not None and len(self.token_ids) < self.limit):
            return "stop"
        return "length"

    def finish(self, reason: str, ended: float | None = None) -> GenerationResult:
        """Fill in the stats (the run ended at `ended`, default now) and return the result. The
        text held back for a possible stop string is in it; `flush()` hands it out."""
        stats, ended = self.stats, now() if ended is None else ended
        if self.first_at is None:
            stats.ttft_s = ended - self.started
        stats.new_tokens = len(self.token_ids)
        stats.decode_s = ended - self.first_at if self.first_at is not None else 0.0
        stats.finish_reason = reason
        return GenerationResult(text=self._deltas.text, token_ids=list(self.token_ids),
                                stats=stats)

    def flush(self) -> str:
        """The text held back, once the run has ended without a stop string."""
        return self._deltas.flush()


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
        progress = RunProgress(run.stats, run.tokenizer, run.stop, limit=run.limit, started=t0)
        reason = "length"  # what a run that fails part-way is counted as
        try:
            for batch in run.tokens:
                if isinstance(batch, int):
                    batch = (batch,)
                progress.arrived()
                for token in batch:
                    delta = progress.push(token)
                    if delta:
                        yield delta
                    if progress.stopped:
                        break
                if progress.stopped:
                    reason = "stop"
                    break
            else:
                reason = progress.natural_reason()
        except GeneratorExit:
            reason = "cancelled"
            raise
        finally:
            close = getattr(run.tokens, "close", None)
            if close is not None:
                close()
            t_end = now()
            run.finish()
            self.result = progress.finish(reason, ended=t_end)
        tail = progress.flush()
        if tail:
            yield tail
