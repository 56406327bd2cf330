"""Ingestion on vLLM: chunk blobs made by vLLM's own batched prefill (the connector's save side).

A vLLM started with `TurboRAGConnector` in `kv_role: kv_both` stores the KV of every request
that asks for it in `kv_transfer_params`:

    {"prompt": ANCHOR_IDS + CHUNK_IDS, "max_tokens": 1,
     "kv_transfer_params": {"turborag_ingest": true}}

The prompt is the anchor's token ids followed by the chunk's, exactly what `ChunkEncoder`
prefills for a chunk; the connector drops the anchor's positions and stores the chunk's keys
and values as the blob `ChunkEncoder` would have made. With the connector's "context_tokens",
the anchor may be followed by the chunk's context (the end of the text before it in its
document, `"turborag_context_len"` tokens of it), dropped like the anchor — same fingerprint, encoding,
base_position and key — so that a corpus is encoded by the serving fleet's engine rather than
by one HF process. The response's `kv_transfer_params.turborag.ingest` says what became of it.

A *lead blob* (core/library.py: a chunk encoded right after an app's prompt head, which the
connector claims for a prompt's first chunk) is ingested the same way: the prompt is the head's
token ids, as a prompt has them before a chunk, then the chunk's, with `"turborag_head_len"`
naming the head's length; the connector stores the chunk under that head's lead encoding.

This module is both ends of that request and imports no vLLM: `chunk_prompt` builds a prompt,
`plan_ingest` checks one (the connector's scheduler), `ingest` sends chunk texts to a running
server through its OpenAI completions API.

Only the training-free encodings (encoder none, with or without an anchor) can be made this
way: a learned encoder's soft tokens and encode-only LoRA are not in the weights vLLM runs, so
the connector refuses `kv_both` with one configured (docs/vllm.md#ingestion-on-vllm).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from ..core.errors import TurboRAGError
from ..core.library import head_ids
from ..core.prefill.anchor import DEFAULT_ANCHOR, anchor_ids
from ..core.prefill.chunk_encoder import chunk_encoding, chunk_token_ids
from ..core.prefill.context import DEFAULT_CONTEXT_TOKENS, context_token_ids
from ..core.settings import with_fields
from ..core.store.namespaces import check_namespace

INGEST = "turborag_ingest"  # kv_transfer_params: true asks for the prompt's chunk to be stored
NAMESPACE = "turborag_namespace"  # the store namespace (tenant) it goes into; default ""
DOC_ID = "turborag_doc_id"  # the document it belongs to (KVStore.delete_doc forgets it)
CONTEXT_LEN = "turborag_context_len"  # prompt tokens after the anchor that are the context
HEAD_LEN = "turborag_head_len"  # the prompt's first tokens are a prompt head: a lead blob


class IngestRequestError(TurboRAGError, ValueError):
    """A request asked for ingestion but cannot be ingested as it is."""


@dataclass(frozen=True)
class IngestPlan:
    """What the worker stores for one ingestion request."""

    chunk_ids: tuple[int, ...]
    anchor_len: int  # prompt positions before the chunk (anchor, context): dropped, the
    # blob's base_position
    namespace: str = ""
    doc_id: str | None = None
    replace: bool = False  # the stored blob under its key was encoded alone: overwrite it
    lead: str | None = None  # a lead blob: the encoding of its prompt head (chunk_encoding)

    @property
    def prompt_len(self) -> int:
        return self.anchor_len + len(self.chunk_ids)


def wants_ingest(params) -> bool:
    return isinstance(params, dict) and bool(params.get(INGEST))


def ingest_params(namespace: str = "", doc_id: str | None = None,
                  context_len: int = 0, head_len: int = 0) -> dict:
    """The `kv_transfer_params` of an ingestion request (head_len: of a lead blob's)."""
    params: dict = {INGEST: True}
    if context_len:
        params[CONTEXT_LEN] = context_len
    if head_len:
        params[HEAD_LEN] = head_len
    if namespace:
        params[NAMESPACE] = namespace
    if doc_id:
        params[DOC_ID] = doc_id
    return params


def plan_ingest(params: dict, prompt_ids: Sequence[int], anchor: Sequence[int], *,
                max_chunk_tokens: int, salt: str | None = None,
                salt_prefix: str = "turborag", context_tokens: int = 0) -> IngestPlan:
    """Check an ingestion request against the encoding the connector stores (its anchor ids,
    its context tokens) and say what to store; IngestRequestError says what is wrong."""
    if salt and salt.startswith(salt_prefix):
        # its prefix-cache hits could be stitched blocks, which are not a causal prefill
        raise IngestRequestError(
            f"an ingestion request must not carry a cache_salt starting with {salt_prefix!r}: "
            "those requests are served from stitched KV, and a blob must be computed")
    prompt_ids, anchor = list(prompt_ids), list(anchor)
    if HEAD_LEN in params:
        return _plan_lead(params, prompt_ids, max_chunk_tokens)
    if prompt_ids[:len(anchor)] != anchor:
        raise IngestRequestError(
            f"the prompt does not start with the {len(anchor)} token ids of the anchor this "
            "connector's chunks are encoded after: build it with "
            "turborag_integrations.vllm.ingest.chunk_prompt (same tokenizer and anchor)")
    context = _tokens(params.get(CONTEXT_LEN) or 0, CONTEXT_LEN, 0)
    if context > context_tokens:
        raise IngestRequestError(
            f"{CONTEXT_LEN} is {context}, but this connector's chunks are encoded after at most "
            f"{context_tokens} context tokens (its extra config's \"context_tokens\"): build "
            "the request with turborag_integrations.vllm.ingest.ingest(context_tokens=...) set "
            "as the connector is")
    chunk = prompt_ids[len(anchor) + context:]
    if len(chunk) > max_chunk_tokens:
        raise IngestRequestError(f"a chunk of {len(chunk)} tokens exceeds the {max_chunk_tokens} "
                                 "the encoder allows after its anchor; split it")
    # the HF encoder would shorten a longer context to fit the window: the blobs would differ
    _check_chunk(chunk, context, f"{context} context tokens", "the anchor only (and its "
                 "context)", max_chunk_tokens)
    return IngestPlan(tuple(chunk), len(anchor) + context, *_where(params))


def _plan_lead(params: dict, prompt_ids: list[int], max_chunk_tokens: int) -> IngestPlan:
    """A lead blob's request: the head is whatever the prompt's first HEAD_LEN tokens are (an
    app's own text, not this connector's anchor), and the chunk follows it with no context."""
    head_len = _tokens(params[HEAD_LEN], HEAD_LEN, 1)
    if params.get(CONTEXT_LEN):
        raise IngestRequestError(f"a lead blob follows its prompt head alone: give {HEAD_LEN} "
                                 f"or {CONTEXT_LEN}, not both")
    chunk = prompt_ids[head_len:]
    _check_chunk(chunk, head_len, f"a {head_len}-token head", f"the {head_len}-token head only",
                 max_chunk_tokens)
    return IngestPlan(tuple(chunk), head_len, *_where(params),
                      lead=chunk_encoding(prompt_ids[:head_len]))


def _tokens(value, name: str, least: int) -> int:
    """A request's token count `value` (of the parameter `name`), checked: a whole number ≥
    `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive whole number" if least > 0 else "a whole number"
        raise IngestRequestError(f"{name} is {kind} of tokens, not {value!r}")
    return value


def _check_chunk(chunk: list[int], before: int, after_what: str, only_what: str,
                 max_chunk_tokens: int) -> None:
    """Refuse an empty chunk, or one that with the `before` tokens ahead of it (`after_what`)
    exceeds what the encoder allows."""
    if not chunk:
        raise IngestRequestError(f"the prompt holds {only_what}: no chunk tokens to store")
    if before + len(chunk) > max_chunk_tokens:
        raise IngestRequestError(
            f"a chunk of {len(chunk)} tokens after {after_what} exceeds the {max_chunk_tokens} "
            "tokens the encoder allows; split the chunk")


def _where(params: dict) -> tuple[str, str | None]:
    """(namespace, doc_id) of an ingestion request, checked."""
    namespace = params.get(NAMESPACE) or ""
    doc_id = params.get(DOC_ID)
    try:
        check_namespace(namespace)
    except (TypeError, ValueError) as exc:
        raise IngestRequestError(f"{NAMESPACE}: {exc}") from None
    if doc_id is not None and not isinstance(doc_id, str):
        raise IngestRequestError(f"{DOC_ID} is a string, not {type(doc_id).__name__}")
    return namespace, doc_id or None


# ---- the client ---------------------------------------------------------------------------------
def chunk_prompt(tokenizer, text: str, anchor: str | None = DEFAULT_ANCHOR,
                 max_chunk_tokens: int | None = None) -> list[int]:
    """The prompt token ids of an ingestion request for `text`: the anchor's ids, then the
    chunk's, each tokenized as `ChunkEncoder` does (anchor: as `TurboRAGEngine` and the
    connector's extra config take it)."""
    return anchor_ids(anchor, tokenizer) + chunk_token_ids(tokenizer, text, max_chunk_tokens)


@dataclass
class IngestReport:
    """What `ingest` did, per text and in all."""

    keys: list[str | None]  # each text's blob key (None where it failed)
    stored: int = 0  # distinct blobs this call had vLLM write
    existing: int = 0  # distinct blobs that were stored already
    errors: dict[int, str] = field(default_factory=dict)  # text index -> why it failed
    # lead blobs, one per text and prompt head: head index -> each text's key (None: failed)
    lead_keys: list[list[str | None]] = field(default_factory=list)
    lead_stored: int = 0
    lead_existing: int = 0
    lead_errors: dict[tuple[int, int], str] = field(default_factory=dict)  # (head, text) -> why


def _tokenizer(spec):
    """A tokenizer as given, or loaded from a bundled model name, a folder or a hub id."""
    if not isinstance(spec, str):
        return spec
    from transformers import AutoTokenizer

    from ..core.bundled import CATALOG, prepare_bundled

    return AutoTokenizer.from_pretrained(
        str(prepare_bundled(spec, progress=False)) if spec in CATALOG else spec)


@dataclass(frozen=True)
class IngestOptions:
    """How `ingest` encodes and sends. tokenizer: a tokenizer, or a bundled model name or folder
    to load one from (None: the served model's name); anchor: the connector's (its extra
    config's "anchor", default "chat"); context_tokens: the connector's "context_tokens", whose
    default this is (a connector with fewer refuses requests with more); heads: an app's prompt
    heads (the text its prompts have before the first chunk, as
    `ChunkLibrary.add_prompt_head` takes it). concurrency: requests in flight (vLLM batches
    them); timeout: seconds per request; api_key: the server's, if it has one."""

    tokenizer: object = None
    anchor: str | None = DEFAULT_ANCHOR
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    heads: tuple[str, ...] = ()
    concurrency: int = 8
    timeout: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", tuple(self.heads))


def ingest(texts: Sequence[str], *, url: str, model: str, namespace: str = "",
           doc_ids: Sequence[str | None] | None = None,
           contexts: Sequence[str | None] | None = None,
           options: IngestOptions | None = None, **settings) -> IngestReport:
    """Have a running vLLM (the connector in kv_both) store the blobs of `texts`.

    url: the server (`http://127.0.0.1:8100`, with or without `/v1`); model: its served model
    name. Each text is one completions request of one new token. contexts: the text before each
    one in its document (None for none), encoded before it as `encode_chunks` does, up to
    `context_tokens` tokens. options: an IngestOptions (the tokenizer, anchor, context tokens and
    prompt heads the connector encodes with; concurrency, timeout, API key); `settings` are its
    fields by name. With heads, each text is also sent right after each head and stored as that
    head's lead blob, which the connector claims for a prompt's first chunk.
    A text that cannot be tokenized (empty) raises before anything is sent; a request the server
    refuses is reported in `errors`; a server that cannot be reached raises ConnectionError.
    """
    o = with_fields(options or IngestOptions(), "vLLM ingestion", **settings)
    tokenizer, anchor, context_tokens, heads = o.tokenizer, o.anchor, o.context_tokens, o.heads
    concurrency, timeout, api_key = o.concurrency, o.timeout, o.api_key
    if doc_ids is not None and len(doc_ids) != len(texts):
        raise ValueError(f"{len(doc_ids)} doc_ids for {len(texts)} texts")
    if contexts is not None and len(contexts) != len(texts):
        raise ValueError(f"{len(contexts)} contexts for {len(texts)} texts")
    tok = _tokenizer(model if tokenizer is None else tokenizer)
    head = anchor_ids(anchor, tok)
    chunks = [chunk_token_ids(tok, t) for t in texts]
    befores = [context_token_ids(tok, contexts[i], context_tokens, texts[i]) if contexts else []
               for i in range(len(texts))]
    # (text index, head index or None, prompt ids, context length, head length)
    jobs = [(i, None, head + b + c, len(b), 0) for i, (b, c) in enumerate(zip(befores, chunks))]
    for h, text in enumerate(heads):
        lead = head_ids(tok, text)
        if not lead:
            raise ValueError(f"prompt head {h} is empty: give the text prompts have before "
                             "their first chunk")
        jobs += [(i, h, lead + c, 0, len(lead)) for i, c in enumerate(chunks)]
    endpoint = url.rstrip("/")
    endpoint = (endpoint if endpoint.endswith("/v1") else endpoint + "/v1") + "/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def send(j: int) -> dict:
        i, _, ids, context_len, head_len = jobs[j]
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": ingest_params(namespace, doc_ids[i] if doc_ids else None,
                                                    context_len, head_len)}
        request = urllib.request.Request(endpoint, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # the server refused this one: say why
            return {"error": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}"}
        except urllib.error.URLError as exc:
            raise ConnectionError(f"no server at {endpoint}: {exc.reason}") from None
        result = ((reply.get("kv_transfer_params") or {}).get("turborag") or {}).get("ingest")
        if result is None:
            return {"error": "the server did not ingest it: start vLLM with TurboRAGConnector "
                             'in "kv_role": "kv_both" (turborag vllm --ingest)'}
        return result

    # a chunk repeated (for the same document) is sent once, as encode_chunks encodes it once
    def same(j: int) -> tuple:
        i, h, ids, _, _ = jobs[j]
        return h, tuple(ids), doc_ids[i] if doc_ids else None

    first: dict[tuple, int] = {}
    for j in range(len(jobs)):
        first.setdefault(same(j), j)
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        sent = dict(zip(first.values(), pool.map(send, first.values())))
    report = IngestReport(keys=[None] * len(texts),
                          lead_keys=[[None] * len(texts) for _ in heads])
    written, held = set(), set()  # (a lead blob?, key)
    for j, (i, h, _, _, _) in enumerate(jobs):
        result = sent[first[same(j)]]
        if result.get("error") or not result.get("stored"):
            why = result.get("error") or "not stored"
            if h is None:
                report.errors[i] = why
            else:
                report.lead_errors[(h, i)] = why
            continue
        (report.keys if h is None else report.lead_keys[h])[i] = result["key"]
        (held if result.get("existing") else written).add((h is not None, result["key"]))

    def count(keys: set, lead: bool) -> int:
        return sum(1 for is_lead, _ in keys if is_lead == lead)

    report.stored, report.existing = count(written, False), count(held - written, False)
    report.lead_stored, report.lead_existing = count(written, True), count(held - written, True)
    return report
