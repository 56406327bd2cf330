"""The token-id span finder: exact matches only, the text finder's overlap rule, heads at 0."""

import pytest

from turborag_integrations.core.prefill.token_spans import SpanEntry, TokenSpanIndex


def entry(key, ids, plain=False):
    return SpanEntry(key, tuple(ids), plain)


def test_finds_chunks_in_prompt_order():
    index = TokenSpanIndex(min_tokens=3, head=2)
    index.add([entry("b", [7, 8, 9]), entry("a", [1, 2, 3, 4])])
    found = index.find([0, 1, 2, 3, 4, 5, 7, 8, 9, 6])
    assert [(m.start, m.entry.key, m.end) for m in found] == [(1, "a", 5), (6, "b", 9)]


def test_a_head_match_with_a_different_tail_is_not_found():
    index = TokenSpanIndex(min_tokens=3, head=2)
    index.add([entry("a", [1, 2, 3, 4])])
    assert index.find([1, 2, 3, 5, 1, 2, 3]) == []


def test_overlaps_keep_the_earlier_then_the_longer():
    index = TokenSpanIndex(min_tokens=3, head=3)
    index.add([entry("short", [1, 2, 3]), entry("long", [1, 2, 3, 4, 5]),
               entry("later", [3, 4, 5, 6])])
    found = index.find([1, 2, 3, 4, 5, 6])
    assert [m.entry.key for m in found] == ["long"]


def test_plain_entries_match_only_at_the_start():
    index = TokenSpanIndex(min_tokens=3, head=3)
    index.add([entry("head", [5, 6, 7], plain=True)])
    assert [m.entry.key for m in index.find([5, 6, 7, 1])] == ["head"]
    assert index.find([1, 5, 6, 7, 1]) == []


def test_short_entries_are_not_indexed_and_keys_are_kept_once():
    index = TokenSpanIndex(min_tokens=4, head=2)
    assert index.add([entry("tiny", [1, 2, 3]), entry("ok", [1, 2, 3, 4]),
                      entry("ok", [9, 9, 9, 9])]) == 1
    assert len(index) == 1 and "ok" in index and "tiny" not in index
    index.discard("ok")
    assert index.find([1, 2, 3, 4]) == [] and len(index) == 0


def test_head_must_fit_the_minimum():
    with pytest.raises(ValueError):
        TokenSpanIndex(min_tokens=4, head=8)
