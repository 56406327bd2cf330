"""TurboRAGEngine: the one object adapters talk to.

    engine = TurboRAGEngine()                         # bundled SmolLM2, store under ~/.cache
    engine.encode_chunks(chunks)                      # once, at ingestion
    result = engine.generate(prompt, chunks=chunks)   # any prompt that contains the chunk texts
    print(result.text, result.stats.ttft_s)
"""

from __future__ import annotations

import copy
import threading
from typing import Callable, Iterable, Sequence

from cachetools import LRUCache

from .admission import Admission
from .config import EngineConfig
from .decode.loop import decode_loop, eos_token_ids, now
from .decode.selfspec import DraftStats
from .decode.start import DecodeStart
from .kv.blob import Fingerprint, fingerprint_model
from .kv.cache import CachePool
from .assembly import PromptAssembly
from .library import ChunkLibrary
from .models import LoadedModel, load_model
from .prefill.anchor import anchor_ids, anchor_text
from .prefill.chunk_encoder import ChunkEncoder
from .prefill.encoding import resolve_encoder
from .prefill.cost import stitching_pays
from .prefill.recovery import NO_RECOVERY, Recovery
from .prefill.rope import KeyRotator
from .prefill.stitch import Prefill, Segment, StitchPlan, plan_prompt, prefill
from .request import Prepared, Request, new_token_limit, reserve_slots
from .run import GenerationResult, GenerationStats, GenerationStream, Run
from .settings import MODES, GenerationConfig
from .store import KVStore

__all__ = ["TurboRAGEngine", "GenerationConfig", "GenerationResult", "GenerationStats",
           "GenerationStream", "MODES"]


class TurboRAGEngine:
    """A model that answers prompts over stored chunk blobs. It has the chunk library those
    blobs are ingested into and found in (`library`, core/library.py) and the assembly that
    turns a prompt into stitched segments (`assembly`, core/assembly.py)."""

    # Namespace views kept at once (`namespaced`): a view is a shallow copy, a few kB.
    MAX_VIEWS = 1024

    def __init__(self, model: str | LoadedModel | None = None, *,
                 store: KVStore | str | None = None, namespace: str = "",
                 config: EngineConfig | None = None, **settings):
        """model: a bundled name, a local folder, a Hugging Face id, or a LoadedModel already
        loaded (then its device and dtype are its own).

        store: a KVStore, or a folder for one (None: the default folder under ~/.cache).
        namespace: the store namespace (a tenant) this engine ingests into and reads from; ""
        (the default) is the single namespace of a store without tenants. One engine serves
        several: `engine.namespaced(name)` (core/store/namespaces.py).

        config: an EngineConfig (core/config.py) — the model's device and dtype, how chunks are
        encoded, how turbo requests are stitched and recovered. `settings` are its fields by
        name, applied on top of it: `TurboRAGEngine(device="cuda", dtype="bfloat16",
        context_tokens=0, recovery="select:0.2")`. Each is described on its dataclass:
        `ModelConfig` (device, dtype, progress, model_kwargs, tokenizer_kwargs),
        `EncodingConfig` (anchor, encoder, context_tokens, prompt_heads, batch_size: part of
        every blob's fingerprint), `QueryConfig` (recovery, question_last, separators,
        cache_prefix, prefetch), and `AdmissionConfig` (admit_after: a hot set encoded on a
        chunk's k-th retrieval instead of every chunk at ingestion, core/admission.py). A bad
        value or an unknown name fails here, before the model loads.
        """
        self.config = (config or EngineConfig()).with_settings(**settings)
        encoding = self.config.encoding
        self.loaded = model if isinstance(model, LoadedModel) else load_model(
            model, self.config.model)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        model_fp = fingerprint_model(self.model, self.tokenizer, self.loaded.name)
        self.rotator = KeyRotator.for_model(self.model)
        self.anchor_text = anchor_text(self.anchor, self.tokenizer)
        # Chunks are encoded after the anchor; the prompt's own head (the text before the first
        # chunk) starts the sequence, so it is encoded plain, at 0..n−1, which is exact.
        self.learned = resolve_encoder(encoding.encoder, self.loaded.name, model_fp.weights)
        if self.learned is not None:
            self.learned.check_model(model_fp.weights, model_fp.tokenizer, self.anchor)
        self._owns_store = not isinstance(store, KVStore)
        root_store = store if isinstance(store, KVStore) else KVStore(store)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.cache_pool = CachePool()
        self._views: LRUCache[tuple[str, tuple[str, ...]], TurboRAGEngine] = LRUCache(
            self.MAX_VIEWS)
        self._views_lock = threading.Lock()
        self.library = ChunkLibrary(
            ChunkEncoder(self.model, self.tokenizer, model_fp, batch_size=encoding.batch_size,
                         anchor_ids=anchor_ids(self.anchor, self.tokenizer), learned=self.learned,
                         context_tokens=encoding.context_tokens),
            ChunkEncoder(self.model, self.tokenizer, model_fp, batch_size=encoding.batch_size),
            root_store.namespace(namespace))
        self.assembly = PromptAssembly(self.library, self.tokenizer, self.config.query)
        # one for the engine and its namespace views: each admission names its own library
        self.admission = Admission(self.config.admission)
        for head in encoding.prompt_heads:
            self.library.add_prompt_head(head)

    # What adapters and entry points read of the library most, named on the engine itself.
    @property
    def store(self) -> KVStore:
        """The store of this engine's namespace."""
        return self.library.store

    @property
    def namespace(self) -> str:
        return self.library.namespace

    @property
    def fingerprint(self) -> Fingerprint:
        """The fingerprint of this engine's chunk blobs (model, anchor, encoding)."""
        return self.library.fingerprint

    @property
    def anchor(self) -> str:
        """What chunks are encoded after (`EncodingConfig.anchor`)."""
        return self.config.encoding.anchor

    @property
    def encodes_at_ingestion(self) -> bool:
        """Whether ingestion stores blobs (the default), or leaves them to the hot set, which
        encodes a chunk on its `admit_after`-th retrieval (core/admission.py). The adapters'
        vector stores ask this before encoding."""
        return not self.admission.enabled

    @property
    def recovery(self) -> Recovery:
        """What a turbo request that names none recomputes (`QueryConfig.recovery`)."""
        return self.config.query.recovery

    def namespaced(self, name: str, *, shared: Sequence[str] = ()) -> "TurboRAGEngine":
        """This engine in namespace `name`: the same model, encoders and cache pool, the store
        of that namespace (core/store/namespaces.py). A chunk without a blob of its own there is
        looked up in the `shared` namespaces too, in order (read only: whatever this view
        encodes goes into `name`). Closing a view closes nothing.

        The same object for the same arguments while it is among the `MAX_VIEWS` most recently
        asked for: a server makes a view per cache salt, and the views of salts gone quiet are
        let go (one still held keeps working; asking again makes an equal one). The chunk keys
        views remember are one bounded cache of the root's (`library.KeyCache`)."""
        key = (name, tuple(shared))
        root = getattr(self, "_root", self)
        if key == (root.namespace, ()):
            return root
        others = tuple(root.namespaced(n) for n in shared if n != name)

        def view() -> TurboRAGEngine:
            made = copy.copy(root)
            made._root, made._owns_store = root, False
            made.library = root.library.view(root.store.namespace(name),
                                             tuple(o.library for o in others))
            made.assembly = root.assembly.over(made.library)
            return made

        with root._views_lock:
            made = root._views.get(key)
            if made is None:
                made = root._views[key] = view()
            return made

    def close(self) -> None:
        """Stop the hot set's encoder (a view leaves it to its engine), and close the KV store
        if this engine opened it (a store passed in stays open)."""
        if getattr(self, "_root", self) is self:
            self.admission.close()
        if self._owns_store:
            self.store.namespace("").close()  # the whole store, every namespace's with it

    def __enter__(self) -> "TurboRAGEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warmup(self) -> None:
        """Run a tiny full and a tiny stitched call (nothing is stored), and encode the stock
        separators between chunks, so that the first timed call pays for neither lazy
        initialisation nor the first cache buffer."""
        if self.config.query.separators:
            self.library.separator_blobs()
        self.generate("Hello", config=GenerationConfig(max_new_tokens=2), mode="naive")
        text = "A short passage used to warm up the stitched path."
        blob = self.library.encoder.encode(text)
        pre = self.prefill([Segment(text, blob), Segment(" Why?")], reserve=2)
        self.cache_pool.release(pre.cache)

    @property
    def context_window(self) -> int:
        return self.loaded.context_window

    # ---- ingestion ---------------------------------------------------------------------------
    def encode_chunks(self, texts: Sequence[str], *, doc_ids: Sequence[str | None] | None = None,
                      contexts: Sequence[str | None] | None = None,
                      progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Encode and store the blobs of chunk `texts` (those not stored yet); return their
        keys. `doc_ids`: each chunk's document, which `forget_document` deletes it with;
        `contexts`: each chunk's text before it in its document, for context encoding;
        `progress(done, total)`. See `ChunkLibrary.encode_chunks`."""
        return self.library.encode_chunks(texts, doc_ids=doc_ids, contexts=contexts,
                                          progress=progress)

    def forget_document(self, doc_id: str) -> list[str]:
        """Drop a document's claim on its blobs; delete those no other document uses.
        Returns the deleted keys."""
        return self.library.store.delete_doc(doc_id)

    def add_prompt(self, rendered: str) -> str:
        """Encode chunks also after the head of a template rendered with CONTEXT_MARKER for its
        chunks and VALUE_MARKER for its other variables (`PromptAssembly.prompt_head`), from
        the next ingestion on; returns that head ("" where the chunks start the prompt: nothing
        to add). The adapters' `add_prompt` render their templates and call this."""
        head = self.assembly.prompt_head(rendered)
        if head:
            self.library.add_prompt_head(head)
        return head

    # ---- generation -------------------------------------------------------------------------
    def prefill(self, segments: Sequence[Segment], *, reserve: int = 0,
                recovery: Recovery | None = None) -> Prefill:
        """The low-level prefill of `segments` (`engine.assembly.segments(prompt, chunks)`):
        a cache ready to decode from, stitched as asked whatever it costs. `recovery`: a parsed
        `Recovery` (`parse_recovery("first")`); None runs the engine's own."""
        return self._prefill(self._plan(segments), reserve,
                             self.assembly.recovery_for(segments, recovery))

    def _plan(self, segments: Sequence[Segment]) -> StitchPlan:
        return plan_prompt(segments, self.tokenizer, fingerprint=self.fingerprint,
                           context_window=self.context_window)

    def _prefill(self, plan: StitchPlan, reserve: int, recovery: Recovery) -> Prefill:
        room = self.context_window - plan.next_position
        # One slot per new token, none past the window: `prefill` also counts these as positions
        # for dynamic RoPE, which fits exactly the window (the last new token is never fed back,
        # so decoding writes fewer; drafts stay within the new tokens).
        return prefill(self.model, plan, self.rotator, extra_capacity=min(reserve, room),
                       pool=self.cache_pool, recovery=recovery)

    def stream(self, prompt: str | Sequence[Segment], *, chunks: Iterable[str] = (),
               config: GenerationConfig | None = None, mode: str = "turbo",
               encode_missing: bool = False, recovery=None) -> GenerationStream:
        """Generate from `prompt` (a string, or ready segments); iterate for text deltas.

        recovery: None, a `recovery.Recovery`, or a spec such as "boundary:16" / "blend:0.15"
        (see core/prefill/recovery.py): recompute some chunk tokens with full context (turbo
        mode).
        """
        request = Request(prompt, tuple(chunks), config or GenerationConfig(), mode,
                          encode_missing, recovery)  # checked here, before any compute
        return GenerationStream(start=lambda: self._run(request))

    def generate(self, prompt: str | Sequence[Segment], *, chunks: Iterable[str] = (),
                 config: GenerationConfig | None = None, mode: str = "turbo",
                 encode_missing: bool = False, recovery=None) -> GenerationResult:
        stream = self.stream(prompt, chunks=chunks, config=config, mode=mode,
                             encode_missing=encode_missing, recovery=recovery)
        for _ in stream:
            pass
        return stream.result  # type: ignore[return-value]

    def start(self, request: Request, *, stats: GenerationStats | None = None) -> Prepared:
        """Prefill `request`'s prompt: split it around its chunks, stitch their blobs, prefill
        the rest, and fill in the prompt's part of `stats` (a new GenerationStats if None).
        The one way from a request to its first logits, on every run path (`stream`, the batch
        scheduler); the caller releases `prepared.prefill.cache` to `cache_pool`."""
        config, mode, prompt = request.config, request.mode, request.prompt
        t0 = now()
        if isinstance(prompt, str) and mode == "turbo":
            # a hot set encodes in the background, never on the request's path
            segments, hits, misses = self.assembly.segments(
                prompt, request.chunks,
                encode_missing=request.encode_missing and not self.admission.enabled)
        elif isinstance(prompt, str):
            segments, hits, misses = [Segment(prompt)], 0, 0
        elif mode == "turbo":
            segments = list(prompt)
            hits, misses = sum(s.cached for s in segments), 0
        else:
            segments, hits, misses = [Segment("".join(s.text for s in prompt))], 0, 0
        t_loaded = now()
        reserve = reserve_slots(config.max_new_tokens,
                                config.draft_tokens + 1 if config.draft else 0)
        recovery = self.assembly.recovery_for(segments, request.recovery)  # once, for both
        plan = self._plan(segments)
        # Where retrieved chunks have no blob (a cold store, a hot set warming up) and too few
        # have one for stitching to be faster, the prompt is prefilled whole: faster, and the
        # exact answer besides (core/prefill/cost.py). A prompt whose chunks all have blobs is
        # stitched as asked.
        full_instead = (mode == "turbo" and misses > 0 and bool(plan.spans)
                        and not stitching_pays(plan, recovery))
        if full_instead:
            plan = self._plan([Segment("".join(s.text for s in segments))])
            recovery = NO_RECOVERY
        with self.admission.prefilling():  # the hot set's encoder waits meanwhile
            pre = self._prefill(plan, reserve, recovery)
        if mode == "turbo":
            # the hot set counts the retrieval and queues what it admits; it never blocks
            self.admission.saw(self.library, request.chunks)
        plan = pre.plan
        stats = stats if stats is not None else GenerationStats(mode=mode)
        # assembly = finding and loading the blobs + re-rotating and concatenating them
        stats.assembly_s = (t_loaded - t0) + pre.timings["assembly_s"]
        stats.prefill_s = pre.timings["prefill_s"]
        stats.prompt_tokens = len(plan.token_ids)
        stats.reused_tokens, stats.prefilled_tokens = plan.reused_tokens, plan.prefilled_tokens
        stats.cache_hits, stats.cache_misses = hits, misses
        if full_instead:
            stats.extra["full_prefill"] = "stitching would be slower: too few chunks have a blob"
        elif mode == "turbo" and any(self.library.is_lead(s.blob) for s in segments):
            stats.extra["lead_blob"] = True  # the first chunk is the full prefill's KV
        if isinstance(prompt, str) and "".join(s.text for s in segments) != prompt:
            stats.extra["question_last"] = True  # the chunks were moved before the question
        if mode == "turbo":
            asked = request.recovery or self.recovery
            stats.extra["recovery"] = str(recovery)
            if str(asked) != str(recovery):
                stats.extra["recovery_asked"] = str(asked)  # "first" over a lead blob: skipped
            # the split of the query-time work: choosing the tokens (recovery_s), then one
            # forward (prefill_s) over the recomputed chunk tokens and the plain ones
            stats.extra["recovery_s"] = pre.timings.get("recovery_s", 0.0)
            stats.extra["recomputed_tokens"] = pre.timings.get("recomputed_tokens", 0)
        limit = new_token_limit(config.max_new_tokens, self.context_window, plan.next_position)
        return Prepared(request, pre, stats, limit)

    def _run(self, request: Request) -> Run:
        prepared = self.start(request)
        pre, stats, config = prepared.prefill, prepared.stats, request.config
        draft_stats = DraftStats() if config.draft else None

        def finish() -> None:
            self.cache_pool.release(pre.cache)
            if draft_stats is not None:
                stats.extra.update(draft_stats.as_dict())

        tokens = decode_loop(self.model, DecodeStart(pre.cache, pre.logits, prepared.position),
                             config,
                             config.end_ids(self.eos_ids), max_new_tokens=prepared.limit,
                             draft_stats=draft_stats)
        return Run(tokens, stats, prepared.limit, self.tokenizer, config.stop, finish)
