"""RAPID: retrieval-augmented speculative decoding (arXiv 2502.20330).

A target model reads the whole long context; a drafter sharing its vocabulary reads only the
chunks retrieved for the question (stitched from their TurboRAG blobs) and proposes γ tokens per
round; the target verifies them in one forward and accepts a prefix.

    rapid = RapidEngine(TurboRAGEngine())                 # self-speculation: one model, two contexts
    result = rapid.generate(long_document, "Who built the kiln?")
    print(result.text, result.stats.acceptance_rate, result.stats.decode_tokens_per_s)

Acceptance (the paper's retrieval-augmented target distribution). With p = softmax(z/T) of the
target and q of the drafter at one position:

    p̂ = softmax(z/T + η(q − p));  wherever p̂_k < 0.1·max p̂, p̂_k ← p_k;  renormalise.

A drafted x is accepted with probability min(1, p̂(x)/q(x)); at the first rejection the token is
drawn from norm(max(p − p̂, p − q, 0)) ("rapid" residual); if all γ are accepted a bonus token
comes from p. With η = 0, p̂ = p and the residual is norm(max(p − q, 0)): standard speculative
sampling, which is lossless (the output follows p exactly). `residual="standard"` draws from
norm(max(p̂ − q, 0)) instead, which makes the output follow p̂ exactly for any η. Greedy (T = 0)
accepts while the drafted token is the target's argmax (of p̂ at T = 1 when η > 0).

Caches: the target cache holds the context and every accepted token but the last; the drafter
cache likewise, plus possibly the last accepted draft when a whole round was accepted. A round
feeds the pending tokens and drafts to both, then truncates both to what was accepted (rollback
is O(1)), so after any round each cache equals a fresh prefill of the accepted sequence.

Reuse: the drafter's chunks come from the KV store as TurboRAG blobs (encoded once, on first
use); the target's long-context prefill is kept as an exact prefix cache: the KV of the prompt up
to the end of the context, stored as a KV blob under the content key of its token ids (a prefix
encoded from position 0 is exactly a chunk blob of those tokens), so a second question on the
same document prefills only the question.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
import xxhash

from .blob import KVBlob
from .cache import KVCache
from .chunking import split_text
from .decode import FastDecoder
from .engine import GenerationStream, TurboRAGEngine
from .errors import ContextWindowError, ModelError
from .generate import GenerationConfig, TextDeltas, eos_token_ids, now, warp_logits
from .rapid_attention import suffix_causal
from .stitch import Segment, sdpa_gqa

log = logging.getLogger(__name__)

TAIL_RATIO = 0.1  # p̂_k below this fraction of max p̂ is reset to p_k
RESIDUALS = ("rapid", "standard")


class VocabularyMismatch(ModelError):
    """Target and drafter do not share one vocabulary."""


# ---- distributions and the acceptance rule ---------------------------------------------------

def augmented_probs(target_logits: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    eta: float) -> torch.Tensor:
    """p̂ = softmax(z + η(q − p)) with the tail rule; `target_logits` are z/T (already warped).

    Works on [..., vocab]. With η = 0 it returns p itself (exactly, not up to rounding).
    """
    if eta == 0:
        return p
    p_hat = torch.softmax(target_logits + eta * (q - p), dim=-1)
    tail = p_hat < TAIL_RATIO * p_hat.amax(-1, keepdim=True)
    p_hat = torch.where(tail, p, p_hat)
    return p_hat / p_hat.sum(-1, keepdim=True)


def residual_probs(p: torch.Tensor, p_hat: torch.Tensor, q: torch.Tensor,
                   residual: str = "rapid") -> torch.Tensor:
    """The distribution to draw from at a rejection (normalised; falls back to p̂ if empty)."""
    if residual == "rapid":
        r = torch.maximum(p - p_hat, p - q).clamp_(min=0)
    else:
        r = (p_hat - q).clamp_(min=0)
    total = r.sum(-1, keepdim=True)
    if float(total) <= 0:  # only by rounding: a rejection implies some mass
        return p_hat
    return r / total


@dataclass
class Verdict:
    accepted: int  # drafted tokens accepted
    token: int  # the token after them: the correction at a rejection, else the bonus


AcceptRule = Callable[..., Verdict]


def accept_drafts(drafts: Sequence[int], target_logits: torch.Tensor, draft_logits: torch.Tensor,
                  config: GenerationConfig, *, eta: float = 0.0, residual: str = "rapid",
                  generator: torch.Generator | None = None) -> Verdict:
    """Verify one round.

    target_logits: [γ + 1, vocab] raw logits of the target at the positions of the drafts and
    one past them; draft_logits: [γ, vocab] raw drafter logits the drafts were drawn from.
    """
    g = len(drafts)
    z = target_logits.float()
    zq = draft_logits.float()
    if config.greedy:
        if eta == 0:
            choice = z[:g + 1].argmax(-1)
        else:
            p, q = z[:g].softmax(-1), zq[:g].softmax(-1)
            choice = torch.cat([augmented_probs(z[:g], p, q, eta).argmax(-1), z[g:].argmax(-1)])
        for i, d in enumerate(drafts):
            if int(choice[i]) != d:
                return Verdict(i, int(choice[i]))
        return Verdict(g, int(choice[g]))
    warped = warp_logits(z, config)
    p_all = warped.softmax(-1)
    if g:
        q = warp_logits(zq, config).softmax(-1)
        p = p_all[:g]
        p_hat = augmented_probs(warped[:g], p, q, eta)
        idx = torch.as_tensor(list(drafts))
        rows = torch.arange(g)
        ratio = p_hat[rows, idx] / q[rows, idx]
        u = torch.rand(g, generator=generator)
        for i in range(g):
            if not bool(u[i] < ratio[i]):  # accept with probability min(1, p̂/q)
                r = residual_probs(p[i], p_hat[i], q[i], residual)
                return Verdict(i, int(torch.multinomial(r, 1, generator=generator)))
    return Verdict(g, int(torch.multinomial(p_all[g], 1, generator=generator)))


def first_token(target_logits: torch.Tensor, draft_logits: torch.Tensor | None,
                config: GenerationConfig, eta: float, generator: torch.Generator) -> int:
    """The first new token, from the two prefills: drawn from p̂ (p when η = 0)."""
    z = target_logits.float()
    if eta == 0 or draft_logits is None:
        if config.greedy:
            return int(z.argmax(-1))
        return int(torch.multinomial(warp_logits(z, config).softmax(-1), 1, generator=generator))
    if config.greedy:
        p, q = z.softmax(-1), draft_logits.float().softmax(-1)
        return int(augmented_probs(z, p, q, eta).argmax(-1))
    warped = warp_logits(z, config)
    p = warped.softmax(-1)
    q = warp_logits(draft_logits.float(), config).softmax(-1)
    return int(torch.multinomial(augmented_probs(warped, p, q, eta), 1, generator=generator))


# ---- the speculative loop --------------------------------------------------------------------

@dataclass
class Side:
    """One model's state: its cache holds every accepted token except `pending`.

    `position` is the RoPE position of the next token fed (stitched caches need not have one
    position per cache entry, so it is tracked apart from the cache length).
    """

    model: object
    cache: KVCache
    logits: torch.Tensor  # next-token logits of the prefill
    position: int
    pending: list[int] = field(default_factory=list)
    fast: bool = True  # decode.FastDecoder where the model allows it, as the plain decode loop

    def __post_init__(self):
        # looked up once per generation, not per fed token (the support check walks the model)
        self._decoder = FastDecoder.for_model(self.model) if self.fast else None

    def feed(self, tokens: Sequence[int], keep: int = 1, verify: bool = False) -> torch.Tensor:
        """Append `tokens` to the cache; return the logits of the last `keep` of them.

        verify: several tokens attend through the split attention of core/rapid_attention.py
        (the fast decoder always does); otherwise through stock SDPA with a mask.
        """
        decoder = self._decoder if verify or len(tokens) == 1 else None
        if decoder is not None:
            with torch.inference_mode():
                logits = decoder.forward(tokens, self.position, self.cache)
            self.position += len(tokens)
            return logits[-keep:]
        device = self.cache.storage.k.device
        ids = torch.tensor([list(tokens)], device=device)
        pos = torch.arange(self.position, self.position + len(tokens), device=device)[None]
        with torch.inference_mode(), suffix_causal(self.model, verify and len(tokens) > 1), \
                sdpa_gqa(device):
            out = self.model(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True,
                             logits_to_keep=keep)
        self.position += len(tokens)
        return out.logits[0, -keep:]

    def rollback(self, drop: int) -> None:
        if drop:
            self.cache.truncate(self.cache.length - drop)
            self.position -= drop


@dataclass
class Round:
    """What one speculative round produced (round 0 is the first token, from the prefills)."""

    tokens: list[int]  # new tokens, in order
    drafted: int
    accepted: int
    eos: bool = False  # generation ended with an end-of-sequence token (not in `tokens`)


def speculate(target: Side, drafter: Side, config: GenerationConfig, *, gamma: int = 10,
              eta: float = 0.0, residual: str = "rapid", eos_ids: Iterable[int] = (),
              max_new_tokens: int | None = None, generator: torch.Generator | None = None,
              accept: AcceptRule = accept_drafts, verify_split: bool = True) -> Iterator[Round]:
    """Yield rounds until max_new_tokens or an end-of-sequence token.

    Between rounds both caches hold exactly the accepted sequence minus the pending tokens.
    """
    if gamma < 1:
        raise ValueError("gamma must be ≥ 1")
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, not {residual!r}")
    eos = set(eos_ids)
    limit = config.max_new_tokens if max_new_tokens is None else max_new_tokens
    if generator is None:
        generator = torch.Generator()
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()
    if limit <= 0:
        return
    token = first_token(target.logits, drafter.logits, config, eta, generator)
    if token in eos:
        yield Round([], 0, 0, eos=True)
        return
    target.pending = [token]
    drafter.pending = [token]
    yield Round([token], 0, 0)
    produced = 1
    while produced < limit:
        g = min(gamma, limit - produced - 1)
        drafts: list[int] = []
        draft_logits = []
        if g > 0:
            logits = drafter.feed(drafter.pending, verify=True)[-1]
            drafter.pending = []
            for j in range(g):
                draft_logits.append(logits)
                if config.greedy:
                    d = int(logits.argmax(-1))
                else:
                    probs = warp_logits(logits.float(), config).softmax(-1)
                    d = int(torch.multinomial(probs, 1, generator=generator))
                drafts.append(d)
                if d in eos or j == g - 1:
                    break  # nothing after an end-of-sequence draft can be accepted
                logits = drafter.feed([d])[-1]
        fed = target.pending + drafts
        t_logits = target.feed(fed, keep=len(drafts) + 1, verify=verify_split)
        verdict = accept(drafts, t_logits,
                         torch.stack(draft_logits) if draft_logits else t_logits[:0],
                         config, eta=eta, residual=residual, generator=generator)
        n = verdict.accepted
        # Target: keep pending + accepted drafts; the new token stays pending.
        target.rollback(len(drafts) - n)
        target.pending = [verdict.token]
        # Drafter: it was fed its pending tokens and drafts[:-1].
        if drafts:
            fed_drafts = len(drafts) - 1
            kept = min(n, fed_drafts)
            drafter.rollback(fed_drafts - kept)
            drafter.pending = drafts[kept:n] + [verdict.token]
        else:
            drafter.pending = drafter.pending + [verdict.token]
        new = drafts[:n] + [verdict.token]
        out = []
        ended = False
        for t in new:
            if t in eos:
                ended = True
                break
            out.append(t)
        out = out[:limit - produced]
        produced += len(out)
        yield Round(out, len(drafts), n, eos=ended)
        if ended:
            return


# ---- drafter context: retrieval over the long context ----------------------------------------

@dataclass
class DrafterContext:
    chunks: list[str]  # in document order
    tokens: int
    retrieved: int  # chunks above the threshold before the budget
    candidates: int  # chunks the context was split into
    budget: int
    retrieval_s: float = 0.0


class _ContextIndex:
    """Chunks, their token counts and embeddings for one long context."""

    def __init__(self, context: str, tokenizer, chunk_tokens: int, embedder):
        from .retrieval import ChunkRetriever

        self.chunks = split_text(context, tokenizer, chunk_tokens)
        self.tokens = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in self.chunks]
        self.retriever = ChunkRetriever(self.chunks, embedder)


# ---- results and stats -----------------------------------------------------------------------

@dataclass
class RapidStats:
    ttft_s: float = 0.0
    target_prefill_s: float = 0.0
    drafter_prefill_s: float = 0.0
    retrieval_s: float = 0.0
    target_prompt_tokens: int = 0
    target_reused_tokens: int = 0  # from the prefix cache
    target_prefix_hit: bool = False
    drafter_prompt_tokens: int = 0
    drafter_reused_tokens: int = 0  # from chunk blobs
    drafter_chunks: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    decode_s: float = 0.0
    prefix_store_s: float = 0.0
    finish_reason: str = ""
    gamma: int = 0
    eta: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verification round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(self.new_tokens - 1, 0)  # the first token comes from the prefills
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted,
                 decode_tokens_per_s=self.decode_tokens_per_s)
        return d


@dataclass
class RapidResult:
    text: str
    token_ids: list[int]
    stats: RapidStats


# ---- the engine ------------------------------------------------------------------------------

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

    gamma: drafts per round; eta: weight of the drafter's distribution in the target's (0 =
    lossless); chunk_tokens, threshold, max_drafter_tokens, compression: the drafter's own
    retrieval (chunks of chunk_tokens; cosine ≥ threshold; at most min(max_drafter_tokens,
    |context| / compression) tokens; kept in document order).
    """

    def __init__(self, target: TurboRAGEngine, drafter: TurboRAGEngine | None = None, *,
                 gamma: int = 10, eta: float = 0.0, residual: str = "rapid",
                 chunk_tokens: int = 512, threshold: float = 0.3, max_drafter_tokens: int = 4096,
                 compression: float = 4.0, embedder=None, prefix_cache: bool = True,
                 template: Callable[[str, str], str] = default_template,
                 system: str | None = None, verify_split: bool = True):
        drafter = drafter or target
        if drafter is not target:
            check_same_vocabulary(target, drafter)
        if gamma < 1:
            raise ValueError("gamma must be ≥ 1")
        if eta < 0:
            raise ValueError("eta must be ≥ 0")
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, not {residual!r}")
        if compression <= 0 or max_drafter_tokens < 1:
            raise ValueError("compression must be > 0 and max_drafter_tokens ≥ 1")
        self.target, self.drafter = target, drafter
        self.gamma, self.eta, self.residual = gamma, eta, residual
        self.chunk_tokens, self.threshold = chunk_tokens, threshold
        self.max_drafter_tokens, self.compression = max_drafter_tokens, compression
        self._embedder = embedder
        self.prefix_cache = prefix_cache
        self.template = template
        self.system = system
        self.verify_split = verify_split
        self.eos_ids = eos_token_ids(target.model, target.tokenizer)
        self._index: tuple[str, _ContextIndex] | None = None
        self._prefix: tuple[str, KVBlob] | None = None  # last prefix blob, always in memory
        self._lock = threading.Lock()

    @property
    def embedder(self):
        if self._embedder is None:
            from .embedding import load_embedder

            self._embedder = load_embedder()
        return self._embedder

    # ---- prompts --------------------------------------------------------------------------
    def render(self, engine: TurboRAGEngine, context: str, question: str) -> tuple[str, str]:
        """(prefix, suffix): the prompt split right after the context (prefix '' if none)."""
        messages = [{"role": "user", "content": self.template(context, question)}]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        prompt = engine.render_chat(messages)
        if not context:
            return "", prompt
        at = prompt.find(context)
        if at < 0:
            raise ValueError("the template must contain the context verbatim")
        end = at + len(context)
        return prompt[:end], prompt[end:]

    def drafter_context(self, context: str, question: str) -> DrafterContext:
        """The drafter's own retrieval: 512-token chunks over `context`, cosine ≥ threshold,
        best first within the token budget, then back in document order."""
        t0 = now()
        digest = xxhash.xxh3_128_hexdigest(context.encode())
        with self._lock:
            if self._index is None or self._index[0] != digest:
                self._index = (digest, _ContextIndex(context, self.drafter.tokenizer,
                                                     self.chunk_tokens, self.embedder))
            index = self._index[1]
        total = sum(index.tokens)
        budget = int(min(self.max_drafter_tokens, total / self.compression))
        hits = index.retriever.search(question, k=len(index.chunks), threshold=self.threshold)
        chosen, used = [], 0
        for hit in hits:  # best first
            n = index.tokens[hit.index]
            if used + n <= budget:
                chosen.append(hit.index)
                used += n
        chosen.sort()
        return DrafterContext([index.chunks[i] for i in chosen], used, len(hits),
                              len(index.chunks), budget, now() - t0)

    # ---- generation -----------------------------------------------------------------------
    def stream(self, context: str, question: str, *, chunks: Sequence[str] | None = None,
               config: GenerationConfig | None = None, gamma: int | None = None,
               eta: float | None = None) -> GenerationStream:
        """Answer `question` over `context`; iterate for text deltas, then read `.result`.

        chunks: the drafter's context given by the caller (in the order given); None: the
        engine retrieves them from `context` itself. An empty list: the question alone.
        """
        config = config or GenerationConfig()
        stream = GenerationStream(iter(()))
        stream._deltas = self._run(stream, context, question, chunks, config,
                                   self.gamma if gamma is None else gamma,
                                   self.eta if eta is None else eta)
        return stream

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
        return prefix_ids, max(0, min(max_new_tokens, engine.context_window - total))

    def target_prefill(self, prefix: str, suffix: str, reserve: int):
        """The target's prefill, reusing the prefix cache. Returns (Prefill, prefix_key, hit)."""
        engine = self.target
        blob, key = None, None
        if prefix and self.prefix_cache:
            key = engine.prefix_key(prefix)
            if self._prefix is not None and self._prefix[0] == key:
                blob = self._prefix[1]
            elif self._native_store():
                blob = engine.store.get(key, engine.prefix_fingerprint)
        segments = [Segment(prefix, blob), Segment(suffix)] if prefix else [Segment(suffix)]
        pre = engine.prefill(segments, reserve=reserve)
        return pre, key, blob is not None

    def _native_store(self) -> bool:
        # A lossy store (int8, half) would make the "exact" prefix cache inexact.
        return self.target.store.storage_dtype == "native"

    def _save_prefix(self, key: str, cache: KVCache, ids: list[int]) -> None:
        n = len(ids)
        blob = KVBlob(token_ids=torch.as_tensor(ids, dtype=torch.long),
                      keys=cache.storage.k[:, 0, :, :n].clone().cpu(),
                      values=cache.storage.v[:, 0, :, :n].clone().cpu(),
                      fingerprint=self.target.prefix_fingerprint)
        self._prefix = (key, blob)
        if self._native_store():
            self.target.store.put(blob)

    def _run(self, stream: GenerationStream, context: str, question: str, chunks, config,
             gamma: int, eta: float) -> Iterator[str]:
        t0 = now()
        stats = RapidStats(gamma=gamma, eta=eta)
        if not question or not question.strip():
            raise ValueError("give a question")
        # Target prompt first: a context too long for the target fails before any compute.
        t_prefix, t_suffix = self.render(self.target, context, question)
        prefix_ids, limit = self.check_target_window(t_prefix, t_suffix, config.max_new_tokens)
        # Drafter context
        if chunks is None:
            dctx = self.drafter_context(context, question) if context else None
            chosen = dctx.chunks if dctx else []
            stats.retrieval_s = dctx.retrieval_s if dctx else 0.0
        else:
            chosen = [c for c in chunks if c and c.strip()]
        d_prefix, d_suffix = self.render(self.drafter, "\n\n".join(chosen), question)
        pre_t, key, hit = self.target_prefill(t_prefix, t_suffix, limit + gamma + 2)
        stats.target_prefill_s = pre_t.timings["assembly_s"] + pre_t.timings["prefill_s"]
        stats.target_prompt_tokens = len(pre_t.plan.token_ids)
        stats.target_reused_tokens = pre_t.plan.reused_tokens
        stats.target_prefix_hit = hit
        # Drafter prefill from chunk blobs
        t1 = now()
        segments, _, _ = self.drafter.segments(d_prefix + d_suffix, chosen, encode_missing=True)
        try:
            pre_d = self.drafter.prefill(segments, reserve=limit + gamma + 2)
        except BaseException:
            self.target.cache_pool.release(pre_t.cache)
            raise
        stats.drafter_prefill_s = now() - t1
        stats.drafter_prompt_tokens = len(pre_d.plan.token_ids)
        stats.drafter_reused_tokens = pre_d.plan.reused_tokens
        stats.drafter_chunks = len(chosen)
        target = Side(self.target.model, pre_t.cache, pre_t.logits, pre_t.next_position)
        drafter = Side(self.drafter.model, pre_d.cache, pre_d.logits, pre_d.next_position)
        deltas = TextDeltas(self.target.tokenizer, config.stop)
        rounds = speculate(target, drafter, config, gamma=gamma, eta=eta, residual=self.residual,
                           eos_ids=self.eos_ids, max_new_tokens=limit,
                           verify_split=self.verify_split)
        t_first = None
        finish = "length"
        try:
            for rnd in rounds:
                if t_first is None:
                    t_first = now()
                    stats.ttft_s = t_first - t0
                else:
                    stats.rounds += 1
                    stats.drafted += rnd.drafted
                    stats.accepted += rnd.accepted
                for token in rnd.tokens:
                    delta = deltas.push(token)
                    if delta:
                        yield delta
                    if deltas.stopped:
                        break
                if deltas.stopped:
                    finish = "stop"
                    break
                if rnd.eos:
                    finish = "stop"
                    break
        except GeneratorExit:
            finish = "cancelled"
            raise
        finally:
            rounds.close()
            t_end = now()
            if key is not None and not hit:
                # Decoding only appends after the prefix, so the cache still holds it exactly.
                self._save_prefix(key, pre_t.cache, prefix_ids)
                stats.prefix_store_s = now() - t_end
            self.target.cache_pool.release(pre_t.cache)
            self.drafter.cache_pool.release(pre_d.cache)
            if t_first is None:
                stats.ttft_s = t_end - t0
            stats.new_tokens = len(deltas.ids)
            stats.decode_s = t_end - t_first if t_first is not None else 0.0
            stats.finish_reason = finish
            stream.result = RapidResult(text=deltas.text, token_ids=list(deltas.ids), stats=stats)
        tail = deltas.flush()
        if tail:
            yield tail


def target_greedy(engine: TurboRAGEngine, prefix: str, suffix: str, max_new_tokens: int) -> list[int]:
    """The target's own greedy answer over the same token ids RAPID uses (prefix and suffix
    tokenized apart): the reference a lossless η = 0 run must reproduce."""
    from .generate import decode_loop

    pre = engine.prefill([Segment(prefix), Segment(suffix)] if prefix else [Segment(suffix)],
                         reserve=max_new_tokens)
    eos = eos_token_ids(engine.model, engine.tokenizer)
    try:
        return list(decode_loop(engine.model, pre.cache, pre.logits, pre.next_position,
                                GenerationConfig(max_new_tokens=max_new_tokens), eos))
    finally:
        engine.cache_pool.release(pre.cache)
