"""The adapters' chunk registry finds its texts in a prompt by content, in one pass over the
prompt (core/prefill/text_spans.py), most recently used first, and forgets what it evicts."""

import time

from turborag_integrations.core.registry import ChunkRegistry

A = ("The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora, and was first "
     "lit in 1871.")
B = "The Velmora ferry stops running every January, when the harbour freezes over."
C = "Short text of forty-odd characters."


def test_found_most_recently_used_first_and_evicted_texts_are_not():
    registry = ChunkRegistry(capacity=2)
    registry.add([A, B])
    prompt = f"Context:\n{A}\n\n{B}\n\nQ: when?"
    assert registry.found_in(prompt) == [B, A]
    registry.add(A)  # used again: the most recent
    assert registry.found_in(prompt) == [A, B]
    registry.add(C)  # evicts B, the least recently used
    assert registry.found_in(prompt + "\n" + C) == [C, A]
    registry.discard(A)
    assert registry.found_in(prompt + "\n" + C) == [C]
    registry.clear()
    assert registry.found_in(prompt + "\n" + C) == [] and len(registry) == 0


def test_a_text_is_found_only_verbatim_and_from_a_word_start():
    registry = ChunkRegistry()
    registry.add([A, "short"])  # under min_chars: never registered
    assert "short" not in registry
    assert registry.found_in(A[:-1] + "2.") == []  # the same head, another ending
    assert registry.found_in("x" + A) == []  # starts inside a word
    assert registry.found_in("(see)\t" + A) == [A]


def test_lookup_does_not_grow_with_the_registered_texts():
    """20,000 registered texts; a 4K-token prompt holding two of them: the lookup reads the
    prompt, not every text (the old scan compared each text with the prompt)."""
    texts = [f"Passage {i}: the registry keeps this text so that prompts holding it find it."
             for i in range(20000)]
    registry = ChunkRegistry(capacity=len(texts))
    registry.add(texts)
    prompt = " ".join(["filler words of a long prompt"] * 600) + f"\n{texts[7]}\n{texts[19999]}"
    start = time.perf_counter()
    for _ in range(20):
        found = registry.found_in(prompt)
    per_lookup = (time.perf_counter() - start) / 20
    assert found == [texts[19999], texts[7]]
    assert per_lookup < 0.05, per_lookup
