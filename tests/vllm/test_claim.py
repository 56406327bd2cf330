"""The claim planner: the prefix `[head][chunk]…[chunk]` that starts the prompt, nothing else."""

from turborag_integrations.core.prefill.token_spans import SpanEntry, SpanMatch
from turborag_integrations.vllm.claim import ClaimedSpan, plan_claim, salt_namespace


def match(start, key, n, plain=False):
    return SpanMatch(start, SpanEntry(key, tuple(range(100, 100 + n)), plain))


PROMPT = list(range(40))


def no_head(ids):
    return None


def test_head_blob_then_adjacent_chunks():
    heads = {tuple(PROMPT[:5]): "head"}
    claim = plan_claim(PROMPT, [match(5, "a", 10), match(15, "b", 10)],
                       lambda ids: heads.get(tuple(ids)))
    assert claim.spans == [ClaimedSpan("head", 0, 5, True), ClaimedSpan("a", 5, 10, False),
                           ClaimedSpan("b", 15, 10, False)]
    assert claim.end == 25 and claim.chunk_tokens == 20


def test_the_first_chunk_after_the_head_is_claimed_from_its_lead_blob():
    heads = {tuple(PROMPT[:5]): "head"}
    chunk_a = tuple(range(100, 110))
    leads = {(tuple(PROMPT[:5]), chunk_a): ("a@head", "anchor:5:x")}
    claim = plan_claim(PROMPT, [match(5, "a", 10), match(15, "b", 10)],
                       lambda ids: heads.get(tuple(ids)),
                       lead_key=lambda head, chunk: leads.get((tuple(head), tuple(chunk))))
    assert claim.spans == [ClaimedSpan("head", 0, 5, True),
                           ClaimedSpan("a@head", 5, 10, False, lead="anchor:5:x"),
                           ClaimedSpan("b", 15, 10, False)]
    # no lead blob for that head: the usual one; a chunk that starts the prompt has no head
    assert plan_claim(PROMPT, [match(5, "a", 10)], lambda ids: heads.get(tuple(ids)),
                      lead_key=lambda head, chunk: None).spans[1].key == "a"
    asked = []
    plan_claim(PROMPT, [match(0, "a", 10)], no_head,
               lead_key=lambda head, chunk: asked.append(head))
    assert asked == []


def test_a_gap_between_chunks_ends_the_claim():
    claim = plan_claim(PROMPT, [match(0, "a", 10), match(12, "b", 10)], no_head)
    assert [s.key for s in claim.spans] == ["a"] and claim.end == 10


def test_no_stored_head_means_no_claim():
    assert plan_claim(PROMPT, [match(5, "a", 10)], no_head).spans == []


def test_the_last_prompt_token_is_left_to_the_engine():
    # a chunk reaching the prompt's last token cannot be claimed: vLLM must compute one token
    claim = plan_claim(PROMPT, [match(0, "a", 30), match(30, "b", 10)], no_head)
    assert claim.end == 30


def test_a_plain_blob_alone_is_a_claim():
    claim = plan_claim(PROMPT, [match(0, "p", 39, plain=True)], no_head)
    assert claim.spans == [ClaimedSpan("p", 0, 39, True)]


def test_nothing_found_nothing_claimed():
    assert plan_claim(PROMPT, [], no_head).end == 0


def test_a_stored_separator_between_chunks_is_claimed():
    separators = {tuple(PROMPT[10:12]): "sep"}
    claim = plan_claim(PROMPT, [match(0, "a", 10), match(12, "b", 10), match(25, "c", 5)],
                       no_head, lambda ids: separators.get(tuple(ids)))
    # the stored two-token separator is claimed; the unknown three-token gap before c ends it
    assert claim.spans == [ClaimedSpan("a", 0, 10, False),
                           ClaimedSpan("sep", 10, 2, False, separator=True),
                           ClaimedSpan("b", 12, 10, False)]
    assert claim.chunk_tokens == 20


def test_a_gap_longer_than_a_separator_is_not_looked_up():
    asked = []
    plan_claim(PROMPT, [match(0, "a", 10), match(20, "b", 10)], no_head,
               lambda ids: asked.append(list(ids)) or "sep", max_separator=4)
    assert asked == []


def test_the_salt_names_the_namespace():
    assert salt_namespace("turborag", "turborag") == ""
    assert salt_namespace("turborag:acme", "turborag") == "acme"
    assert salt_namespace("turborag:acme:s1", "turborag") == "acme/s1"
    # any other salt with the prefix: a namespace of its own, never a tenant's
    assert salt_namespace("turborag-x", "turborag") == "/-x"
    assert salt_namespace("turboragacme", "turborag") == "/acme" != salt_namespace(
        "turborag:acme", "turborag")
    assert salt_namespace(None, "turborag") is None
    assert salt_namespace("plain", "turborag") is None


def test_a_salted_request_reads_its_tenants_chunks_and_the_public_ones():
    from turborag_integrations.core.store.namespaces import PUBLIC, readable

    assert readable("acme/s1") == ("acme/s1", "acme", PUBLIC)
    assert readable("acme") == ("acme", PUBLIC)
    assert readable("") == ("", PUBLIC)
    # a salt on a store without tenants reads the default namespace's chunks
    assert readable(salt_namespace("turborag-user7", "turborag")) == ("/-user7", "", PUBLIC)
    assert readable("acme/s1", public=False) == ("acme/s1", "acme")


def test_a_recovery_is_refused_with_what_to_use_instead():
    from turborag_integrations.vllm.claim import recovery_refusal

    assert recovery_refusal(None) is None and recovery_refusal({}) is None
    assert recovery_refusal({"turborag_recovery": "none"}) is None
    for spec in ("select:0.15", "boundary:16", "first"):
        why = recovery_refusal({"turborag_recovery": spec})
        assert spec in why and "claimed nothing" in why and "turborag serve" in why
        assert "skip_reading_prefix_cache" in why  # vLLM's own switch for a full prefill
    bad = recovery_refusal({"turborag_recovery": "select:7"})
    assert "(0, 1]" in bad and "no recovery" in bad
