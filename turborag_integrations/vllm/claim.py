"""Which prompt prefix an engine that fills prompts front to back can take from stored blobs.

vLLM's connector interface supplies a run of tokens right after those vLLM already holds, and
vLLM computes the rest, causally. A TurboRAG prompt `[head][chunk 1]…[chunk k][question]` fits:
the head is a plain blob (encoded at 0..n−1, exactly a full prefill of it), each chunk an
independently encoded blob whose keys are re-rotated to where it sits, and the question is left
to vLLM, attending to everything. Only a run that starts the prompt can be claimed, so the claim
stops at the first token no blob covers. A separator between two chunks (the "\n\n" a template
inserts) is claimed when it is stored like a chunk (core/prefill/separators.py; the connector
stores the stock ones when it starts); any other text between chunks ends the claim, and so
does a head with no stored blob (the connector encodes heads it has not seen).

Pure functions of token ids and keys: the connector (connector.py) and its tests share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..core.prefill.token_spans import SpanMatch
from ..core.store.namespaces import namespace_of


@dataclass(frozen=True)
class ClaimedSpan:
    key: str  # the blob's store key
    start: int  # where its first token sits in the prompt
    length: int
    plain: bool  # a prompt-head blob (positions 0..n−1, no rotation)
    separator: bool = False  # a stored separator between two chunks (encoded like a chunk)
    # a lead blob (the first chunk encoded right after this prompt's head, core/library.py):
    # the fingerprint encoding it was stored under; None for the usual chunk encoding
    lead: str | None = None


@dataclass
class Claim:
    spans: list[ClaimedSpan] = field(default_factory=list)

    @property
    def end(self) -> int:
        """One past the last claimed token (0: nothing claimed)."""
        return self.spans[-1].start + self.spans[-1].length if self.spans else 0

    @property
    def chunk_tokens(self) -> int:
        return sum(s.length for s in self.spans if not (s.plain or s.separator))


def plan_claim(prompt_ids: Sequence[int], matches: Sequence[SpanMatch],
               head_key: Callable[[Sequence[int]], str | None],
               separator_key: Callable[[Sequence[int]], str | None] = lambda ids: None,
               max_separator: int = 4,
               lead_key: Callable[[Sequence[int], Sequence[int]],
                                  tuple[str, str] | None] = lambda head, chunk: None) -> Claim:
    """The longest claimable prefix of `prompt_ids`: the head, then chunks, each right after
    the one before or after a stored separator of at most `max_separator` tokens.

    `matches` are the finder's non-overlapping matches over the prompt; `head_key(ids)` and
    `separator_key(ids)` return the key of a stored plain (head) or chunk-encoded (separator)
    blob of exactly these ids, or None; `lead_key(head_ids, chunk_ids)` the (key, encoding) of
    the stored lead blob of the chunk right after that head, or None (then its usual blob is
    claimed). The last prompt token is never claimed: vLLM must compute at least one token to
    produce the first new one.
    """
    limit = len(prompt_ids) - 1
    matches = [m for m in matches if m.end <= limit]
    if not matches:
        return Claim()
    spans: list[ClaimedSpan] = []
    first = matches[0]
    if first.entry.plain or first.start == 0:
        # a plain blob of the head, or a chunk that starts the prompt (it sees nothing before
        # it either way)
        spans.append(ClaimedSpan(first.entry.key, 0, len(first.entry.token_ids),
                                 first.entry.plain))
        rest = matches[1:]
    else:
        key = head_key(prompt_ids[:first.start])
        if key is None:
            return Claim()
        spans.append(ClaimedSpan(key, 0, first.start, True))
        rest = matches
    cursor = spans[-1].length
    head = prompt_ids[:cursor] if spans[0].plain else None
    for match in rest:
        if match.entry.plain or match.start < cursor:
            break
        if head is not None and match.start == cursor and len(spans) == 1:
            lead = lead_key(head, match.entry.token_ids)
            if lead is not None:  # the first chunk, exactly as a full prefill computes it
                spans.append(ClaimedSpan(lead[0], match.start, len(match.entry.token_ids),
                                         False, lead=lead[1]))
                cursor = match.end
                continue
        if match.start > cursor:
            gap = prompt_ids[cursor:match.start]
            key = separator_key(gap) if len(gap) <= max_separator else None
            if key is None:
                break
            spans.append(ClaimedSpan(key, cursor, len(gap), False, separator=True))
        spans.append(ClaimedSpan(match.entry.key, match.start, len(match.entry.token_ids), False))
        cursor = match.end
    return Claim(spans)


def salt_namespace(salt: str | None, prefix: str) -> str | None:
    """The namespace a request's `cache_salt` names, or None when it does not opt in.

    `prefix` → the default namespace; `prefix:TENANT` → TENANT; `prefix:TENANT:SALT` →
    TENANT/SALT (namespaces.namespace_of); any other salt that starts with `prefix` → the
    default tenant split by the rest, so that no two salts share a namespace."""
    if not salt or not salt.startswith(prefix):
        return None
    rest = salt[len(prefix):]
    if not rest.startswith(":"):
        return namespace_of("", rest)
    tenant, _, split = rest[1:].partition(":")
    return namespace_of(tenant, split)


RECOVERY = "turborag_recovery"  # kv_transfer_params key: the recovery a request asks for


def recovery_refusal(params) -> str | None:
    """Why a request's `kv_transfer_params.turborag_recovery` cannot be honoured here, or None
    when it asks for none. vLLM fills a prompt front to back: the connector can hand it a run of
    stored KV, never recompute tokens inside that run, so any recovery other than "none" is
    refused and nothing is claimed. vLLM still reuses what its own prefix cache holds under the
    same salt (possibly stitched KV an earlier request was given), so the reason names
    `skip_reading_prefix_cache`, vLLM's own switch for a full prefill."""
    from ..core.prefill.recovery import NO_RECOVERY, parse_recovery

    spec = params.get(RECOVERY) if isinstance(params, dict) else None
    if spec is None:
        return None
    try:
        if parse_recovery(spec) is NO_RECOVERY:
            return None
    except ValueError as exc:
        return f"{exc}; and vLLM's connector runs no recovery in any case"
    return (f"recovery {spec!r} cannot run inside vLLM: its connector only loads stored KV "
            "prefixes and cannot recompute tokens within them, so it claimed nothing and vLLM "
            "prefilled what its own prefix cache did not hold (for a full prefill past blocks "
            "cached by an earlier stitched request, also set skip_reading_prefix_cache=True). "
            "Query-time recovery runs in the HF engine: `turborag serve` (docs/serving.md) or "
            "the LlamaIndex/LangChain LLMs")
