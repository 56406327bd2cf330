"""RAPID: retrieval-augmented speculative decoding (arXiv 2502.20330), the facade.

A target model reads the whole long context; a drafter sharing its vocabulary reads only the
chunks retrieved for the question (stitched from their TurboRAG blobs) and proposes γ tokens per
round; the target verifies them in one forward and accepts a prefix (rapid/speculation.py; the
acceptance math is decode/sampling.py).

    rapid = RapidEngine(TurboRAGEngine())                 # self-speculation: one model, two contexts
    result = rapid.generate(long_document, "Who built the kiln?")
    print(result.text, result.stats.acceptance_rate, result.stats.decode_tokens_per_s)

Reuse: the drafter's chunks come from the KV store as TurboRAG blobs (encoded once, on first
use); the target's long-context prefill is kept as an exact prefix cache: the KV of the prompt up
to the end of the context, stored as a KV blob under the content key of its token ids (a prefix
encoded from position 0 is exactly a chunk blob of those tokens), so a second question on the
same document prefills only the question.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import xxhash

from ..decode.loop import decode_loop, eos_token_ids, now
from ..decode.selfspec import DraftStats
from ..decode.start import DecodeStart
from ..engine import TurboRAGEngine
from ..errors import ContextWindowError, ModelError
from ..kv.blob import KVBlob
from ..kv.cache import KVCache
from ..prefill.recovery import NO_RECOVERY
from ..prefill.stitch import Prefill, Segment
from ..request import new_token_limit, reserve_slots
from ..run import GenerationResult, GenerationStream, Run, RunStats
from ..settings import GenerationConfig, SpeculationConfig
from .config import RapidConfig
from .context import ContextIndex, DrafterContext, document_order
from .policy import CostTable, SpeculationPolicy
from .speculation import Side, speculate
from ..prompt_template import render_chat

log = logging.getLogger(__name__)


class VocabularyMismatch(ModelError):
    """Target and drafter do not share one vocabulary."""


@dataclass
class RapidStats(RunStats, DraftStats):
    """What one RAPID call cost: both prefills, the drafter's retrieval, the rounds."""

    target_prefill_s: float = 0.0
    drafter_prefill_s: float = 0.0
    retrieval_s: float = 0.0
    target_prompt_tokens: int = 0
    target_reused_tokens: int = 0  # from the prefix cache
    target_prefix_hit: bool = False
    drafter_prompt_tokens: int = 0
    drafter_reused_tokens: int = 0  # from chunk blobs
    drafter_chunks: int = 0
    prefix_store_s: float = 0.0
    gamma: int = 0
    eta: float = 0.0
    draft_s: float = 0.0  # drafter steps, all rounds
    draft_steps: int = 0
    verify_s: float = 0.0  # target verification forwards, all rounds
    # the policy's decisions (core/rapid/policy.py): rounds speculated and plain steps, mean γ,
    # the predicted speed-up, whether speculation was switched off, the acceptance estimate
    policy: dict = field(default_factory=dict)

    @property
    def draft_step_ms(self) -> float:
        return 1e3 * self.draft_s / self.draft_steps if self.draft_steps else 0.0

    @property
    def verify_ms(self) -> float:
        """One verification forward (γ + 1 tokens at most), averaged over the rounds."""
        return 1e3 * self.verify_s / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted,
                 draft_step_ms=self.draft_step_ms, verify_ms=self.verify_ms)
        return d


# The drafter's context in RAPID's reference code: 128-token chunks, the best of them by
# similarity to the question (no threshold) up to max(|C| / 32, 4096) tokens.
REFERENCE_CONTEXT = dict(chunk_tokens=128, threshold=-1.0, compression=32.0,
                         min_drafter_tokens=4096, max_drafter_tokens=None)


RapidResult = GenerationResult  # text, token ids, and RapidStats


def check_same_vocabulary(target: TurboRAGEngine, drafter: TurboRAGEngine) -> None:
    t_name, d_name = target.loaded.name, drafter.loaded.name
    if target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise VocabularyMismatch(
            f"RAPID needs one vocabulary: the target {t_name!r} and the drafter {d_name!r} have "
            "different tokenizers. Pick a drafter from the target's model family.")
    tv = target.model.get_output_embeddings().weight.shape[0]
    dv = drafter.model.get_output_embeddings().weight.shape[0]
    if tv != dv:
        raise VocabularyMismatch(
            f"RAPID needs one vocabulary: the target {t_name!r} scores {tv} tokens and the "
            f"drafter {d_name!r} scores {dv}.")


def default_template(context: str, question: str) -> str:
    """The user turn: the context, a blank line, the question (the question alone if no context)."""
    return f"{context}\n\n{question}" if context else question


def split_question(text: str) -> tuple[str, str]:
    """(context, question) of a prompt that ends with its question after a blank line."""
    head, sep, tail = text.rstrip().rpartition("\n\n")
    if not sep or not tail.strip():
        return "", text.strip()
    return head, tail.strip()


class RapidEngine:
    """RAPID over two TurboRAGEngines (one engine = self-speculation: same model, short context).

    config: a `RapidConfig` (core/rapid/config.py) — the verification rounds and the drafter's
    own retrieval; `settings` are its fields (and its SpeculationConfig's) by name, applied on
    top: `RapidEngine(target, drafter, gamma=4, max_drafter_tokens=2048)`.
    `RapidEngine.reference(...)` uses the reference code's drafter context (`REFERENCE_CONTEXT`).
    embedder: what the drafter's retrieval embeds with (None: the bundled MiniLM, on first use).
    template, system: how a context and a question become the user turn, and a system turn.
    """

    def __init__(self, target: TurboRAGEngine, drafter: TurboRAGEngine | None = None, *,
                 config: RapidConfig | None = None, embedder=None,
                 template: Callable[[str, str], str] = default_template,
                 system: str | None = None, **settings):
        self.config = (config or RapidConfig()).with_settings(**settings)
        drafter = drafter or target
        if drafter is not target:
            check_same_vocabulary(target, drafter)
        if self.config.drafter_quantize is not None:  # fails now, not at the first answer
            Side(drafter.model, None, None, 0, quantize=self.config.drafter_quantize)
        self.target, self.drafter = target, drafter
        self._embedder = embedder
        self.template = template
        self.system = system
        self.eos_ids = eos_token_ids(target.model, target.tokenizer)
        self._index: tuple[str, ContextIndex] | None = None
        self._prefix: tuple[str, KVBlob] | None = None  # last prefix blob, always in memory
        self._lock = threading.Lock()
        # what speculation costs here, by context length, learned from the answers
        # (core/rapid/policy.py)
        self.costs = CostTable()

    @classmethod
    def reference(cls, target: TurboRAGEngine, drafter: TurboRAGEngine | None = None,
                  **kwargs) -> "RapidEngine":
        """RAPID with the reference code's drafter context (`REFERENCE_CONTEXT`: 128-token
        chunks, the best up to max(|C| / 32, 4096) tokens); other settings as given."""
        return cls(target, drafter, **{**REFERENCE_CONTEXT, **kwargs})

    def drafter_budget(self, context_tokens: int) -> int:
        """Tokens of retrieved chunks the drafter may read for a context of this length."""
        cap = context_tokens / self.config.compression
        if self.config.max_drafter_tokens is not None:
            cap = min(cap, self.config.max_drafter_tokens)
        return int(min(context_tokens, max(self.config.min_drafter_tokens, cap)))

    @property
    def embedder(self):
        if self._embedder is None:
            from ..retrieval.embedding import load_embedder

            self._embedder = load_embedder()
        return self._embedder

    # ---- prompts --------------------------------------------------------------------------
    def render(self, engine: TurboRAGEngine, context: str, question: str,
               system: str | None = None) -> tuple[str, str]:
        """(prefix, suffix): the prompt split right after the context (prefix '' if none).
        system: this prompt's system turn ("": none; None: the engine's `system`)."""
        messages = [{"role": "user", "content": self.template(context, question)}]
        system = self.system if system is None else system
        if system:
            messages.insert(0, {"role": "system", "content": system})
        prompt = render_chat(engine.tokenizer, messages)
        if not context:
            return "", prompt
        at = prompt.find(context)
        if at < 0:
            raise ValueError("the template must contain the context verbatim")
        end = at + len(context)
        return prompt[:end], prompt[end:]

    def drafter_context(self, context: str, question: str) -> DrafterContext:
        """The drafter's own retrieval: chunk_tokens-token chunks over `context`, cosine ≥
        threshold, best first within the token budget, then back in document order."""
        t0 = now()
        # chunk_tokens is a public setting: a changed one must not reuse the old chunks
        digest = f"{self.config.chunk_tokens}:{xxhash.xxh3_128_hexdigest(context.encode())}"
        with self._lock:
            if self._index is None or self._index[0] != digest:
                self._index = (digest, ContextIndex(context, self.drafter.tokenizer,
                                                    self.config.chunk_tokens, self.embedder))
            index = self._index[1]
        budget = self.drafter_budget(sum(index.tokens))
        chosen, used, retrieved = index.select(question, threshold=self.config.threshold, budget=budget)
        return DrafterContext([index.chunks[i] for i in chosen], used, retrieved,
                              len(index.chunks), budget, now() - t0)

    # ---- generation -----------------------------------------------------------------------
    def stream(self, context: str, question: str, *, chunks: Sequence[str] | None = None,
               config: GenerationConfig | None = None, gamma: int | None = None,
               eta: float | None = None, system: str | None = None) -> GenerationStream:
        """Answer `question` over `context`; iterate for text deltas, then read `.result`.

        chunks: the drafter's context given by the caller (a framework's retriever), read in
        document order (`rapid.context.document_order`); None: the engine retrieves them from
        `context` itself. An empty list: the question alone. system: both prompts' system
        turn for this call ("": none; None: the engine's `system`).
        """
        config = config or GenerationConfig()
        asked = {k: v for k, v in (("gamma", gamma), ("eta", eta)) if v is not None}
        speculation = dataclasses.replace(self.config.speculation, **asked)  # validated there
        return GenerationStream(start=lambda: self._start(context, question, chunks, config,
                                                          speculation, system))

    def generate(self, context: str, question: str, **kwargs) -> RapidResult:
        stream = self.stream(context, question, **kwargs)
        for _ in stream:
            pass
        return stream.result  # type: ignore[return-value]

    def check_target_window(self, prefix: str, suffix: str,
                            max_new_tokens: int) -> tuple[list[int], int]:
        """Tokenize the target prompt and check it fits, before any compute.

        Returns (prefix_ids, limit): limit is max_new_tokens clipped to the room left.
        """
        engine = self.target
        tok = engine.tokenizer
        prefix_ids = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        total = len(prefix_ids) + len(tok(suffix, add_special_tokens=False)["input_ids"])
        if total + 1 > engine.context_window:
            raise ContextWindowError(
                f"the prompt is {total} tokens, more than the target {engine.loaded.name!r} can "
                f"read (context window {engine.context_window}, and at least one token to "
                "generate); shorten the context")
        return prefix_ids, new_token_limit(max_new_tokens, engine.context_window, total)

    def target_prefill(self, prefix: str, suffix: str, reserve: int):
        """The target's prefill, reusing the prefix cache. Returns (Prefill, prefix_key, hit)."""
        return self.cached_prefill(self.target, prefix, suffix, reserve)

    def cached_prefill(self, engine: TurboRAGEngine, prefix: str, suffix: str, reserve: int):
        """`engine`'s prefill of prefix + suffix, the prefix's KV read from the prefix cache
        when it is there (the target's last one is also kept in memory). Returns (Prefill,
        prefix_key, hit); `save_prefix` stores a missed prefix after decoding."""
        blob, key = None, None
        if prefix and self.config.prefix_cache:
            key = engine.library.prefix_key(prefix)
            if engine is self.target and self._prefix is not None and self._prefix[0] == key:
                blob = self._prefix[1]
            elif self._native_store(engine):
                blob = engine.store.get(key, engine.library.prefix_fingerprint)
        segments = [Segment(prefix, blob), Segment(suffix)] if prefix else [Segment(suffix)]
        pre = engine.prefill(segments, reserve=reserve)
        return pre, key, blob is not None

    @staticmethod
    def _native_store(engine: TurboRAGEngine) -> bool:
        # A lossy store (int8, half) would make the "exact" prefix cache inexact.
        return engine.store.storage_dtype == "native"

    def save_prefix(self, engine: TurboRAGEngine, key: str, cache: KVCache,
                    ids: list[int]) -> None:
        """Store the first len(ids) entries of `cache` (a prefill from position 0 of `ids`) as
        `engine`'s prefix blob under `key`."""
        keys, values = cache.export(len(ids))
        blob = KVBlob(token_ids=torch.as_tensor(ids, dtype=torch.long), keys=keys,
                      values=values, fingerprint=engine.library.prefix_fingerprint)
        if engine is self.target:
            self._prefix = (key, blob)
        if self._native_store(engine):
            engine.library.keep(blob, kind="prefix")  # bounded apart from the chunk blobs

    def drafter_prefill(self, context: str, question: str, chunks, stats: RapidStats,
                        reserve: int, system: str | None = None) -> Prefill:
        """The drafter's prompt over its chunks (None: its own retrieval; see `stream`),
        stitched from their blobs (encoded on first use); fills the drafter's fields of
        `stats`. The caller releases the cache to `self.drafter.cache_pool`."""
        if chunks is None:
            dctx = self.drafter_context(context, question) if context else None
            chosen = dctx.chunks if dctx else []
            stats.retrieval_s = dctx.retrieval_s if dctx else 0.0
        else:
            chosen = document_order(context, list(chunks))
        prefix, suffix = self.render(self.drafter, "\n\n".join(chosen), question, system)
        t0 = now()
        segments, _, _ = self.drafter.assembly.segments(prefix + suffix, chosen,
                                                        encode_missing=True)
        # the drafter's stitch as it is: a draft only has to be likely, the target verifies it
        pre = self.drafter.prefill(segments, reserve=reserve, recovery=NO_RECOVERY)
        stats.drafter_prefill_s = now() - t0
        stats.drafter_prompt_tokens = len(pre.plan.token_ids)
        stats.drafter_reused_tokens = pre.plan.reused_tokens
        stats.drafter_chunks = len(chosen)
        return pre

    def _start(self, context: str, question: str, chunks, config: GenerationConfig,
               speculation: SpeculationConfig, system: str | None) -> Run:
        stats = RapidStats(gamma=speculation.gamma, eta=speculation.eta)
        if not question or not question.strip():
            raise ValueError("give a question")
        # Target prompt first: a context too long for the target fails before any compute.
        t_prefix, t_suffix = self.render(self.target, context, question, system)
        prefix_ids, limit = self.check_target_window(t_prefix, t_suffix, config.max_new_tokens)
        # a round writes up to γ drafts past the accepted tokens, after the pending ones (the
        # drafter may hold two)
        reserve = reserve_slots(limit, drafted=speculation.gamma + 2)
        pre_t, key, hit = self.target_prefill(t_prefix, t_suffix, reserve)
        stats.target_prefill_s = pre_t.timings["assembly_s"] + pre_t.timings["prefill_s"]
        stats.target_prompt_tokens = len(pre_t.plan.token_ids)
        stats.target_reused_tokens = pre_t.plan.reused_tokens
        stats.target_prefix_hit = hit
        try:
            pre_d = self.drafter_prefill(context, question, chunks, stats, reserve, system)
        except BaseException:
            self.target.cache_pool.release(pre_t.cache)
            raise
        target = Side(self.target.model, pre_t.cache, pre_t.logits, pre_t.next_position)
        try:
            drafter = Side(self.drafter.model, pre_d.cache, pre_d.logits, pre_d.next_position,
                           quantize=self.config.drafter_quantize)
        except BaseException:
            self.target.cache_pool.release(pre_t.cache)
            self.drafter.cache_pool.release(pre_d.cache)
            raise
        policy = SpeculationPolicy(speculation.policy, speculation.gamma,
                                   self.costs.at(stats.target_prompt_tokens))
        rounds = speculate(target, drafter, dataclasses.replace(config, max_new_tokens=limit),
                           speculation, eos_ids=config.end_ids(self.eos_ids), policy=policy)

        def finish() -> None:
            if key is not None and not hit:
                # Decoding only appends after the prefix, so the cache still holds it exactly.
                t0 = now()
                self.save_prefix(self.target, key, pre_t.cache, prefix_ids)
                stats.prefix_store_s = now() - t0
            self.target.cache_pool.release(pre_t.cache)
            self.drafter.cache_pool.release(pre_d.cache)

        return Run(_counted(rounds, stats, policy), stats, limit, self.target.tokenizer,
                   config.stop, finish)


def _counted(rounds, stats: RapidStats, policy: SpeculationPolicy):
    """The rounds' tokens, counting drafts and acceptances (round 0 is the first token, from the
    prefills, not a verification)."""
    try:
        for i, rnd in enumerate(rounds):
            if i and rnd.drafted:  # a plain target step is not a verification round
                stats.rounds += 1
                stats.drafted += rnd.drafted
                stats.accepted += rnd.accepted
                stats.draft_s += rnd.draft_s
                stats.draft_steps += rnd.draft_steps
                stats.verify_s += rnd.verify_s
            yield rnd.tokens
    finally:
        rounds.close()
        stats.policy = policy.as_dict()


def target_greedy(engine: TurboRAGEngine, prefix: str, suffix: str, max_new_tokens: int) -> list[int]:
    """The target's own greedy answer over the same token ids RAPID uses (prefix and suffix
    tokenized apart): the reference a lossless η = 0 run must reproduce."""
    pre = engine.prefill([Segment(prefix), Segment(suffix)] if prefix else [Segment(suffix)],
                         reserve=reserve_slots(max_new_tokens))
    eos = eos_token_ids(engine.model, engine.tokenizer)
    try:
        return list(decode_loop(engine.model, DecodeStart(pre.cache, pre.logits, pre.next_position),
                                GenerationConfig(max_new_tokens=max_new_tokens), eos))
    finally:
        engine.cache_pool.release(pre.cache)
