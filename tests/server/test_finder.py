"""The content-based chunk lookup: exactly the indexed texts a prompt contains, found in time
that grows with the prompt, not with the number of texts indexed."""

import random
import statistics
import time

from turborag_integrations.core.registry import ChunkRegistry
from turborag_integrations.core.prefill.text_spans import PREFIX_CHARS, ChunkIndex
from turborag_integrations.server.finder import ChunkFinder

A = ("The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora, and was first "
     "lit in 1871.")
B = "The Velmora ferry stops running every January, when the harbour freezes over."
C = "Short text of forty-odd characters."  # under PREFIX_CHARS: filed under a shorter head


def test_finds_exactly_the_texts_the_prompt_contains_in_order():
    index = ChunkIndex()
    assert index.add([A, B, C, "The Orbital Kiln Company fires ceramic tiles for satellites."]) == 4
    prompt = f"Context:\n{B}\n\n{A} {C}\nQuestion: how high?"
    assert index.find(prompt) == [B, A, C]


def test_a_text_whose_head_matches_but_whose_rest_differs_is_not_found():
    twin = A[:PREFIX_CHARS] + " but is this the rest of the same passage? No, it is not."
    index = ChunkIndex()
    index.add([A, twin])
    assert index.find(f"Context:\n{A}\nQ?") == [A]
    assert index.find(f"Context:\n{twin}\nQ?") == [twin]
    assert index.find(f"Context:\n{A[:-1]}\nQ?") == []  # one character short


def test_texts_start_at_word_starts_with_their_own_white_space_verbatim():
    padded = "\n\n  " + B
    index = ChunkIndex()
    index.add([padded, A])
    assert index.find("x\n\n  " + B) == [padded]
    assert index.find("x\n " + B) == []  # other white space before it: not this text
    assert index.find("x" + A) == []  # inside a word: not a start
    assert index.find(A) == [A]  # the very start of the prompt


def test_overlaps_keep_the_earlier_then_the_longer_and_repeats_count_once():
    longer = A + " It is painted white."
    index = ChunkIndex()
    index.add([A, longer, B])
    assert index.find(f"{longer}\n{B}\n{B}") == [longer, B]


def test_short_texts_are_skipped_and_texts_can_be_discarded():
    index = ChunkIndex()
    assert index.add(["too short to be worth it", "   ", A, A]) == 1
    index.discard(A)
    index.discard(B)  # not there: nothing happens
    assert len(index) == 0 and index.find(A) == []


def test_the_finder_follows_a_registry_and_keeps_what_was_ingested():
    registry = ChunkRegistry(capacity=2)
    finder = ChunkFinder(registry)
    prompt = f"{A}\n{B}\n{C}"
    registry.add([A, B])
    assert finder.find(prompt) == [A, B]
    finder.add([B])  # ingested through the server too: stays when the registry drops it
    registry.add([C, "A fourth registered text, long enough to count."])  # evicts A and B
    assert finder.find(prompt) == [B, C]


def synthetic_texts(rng: random.Random, count: int, words: int) -> list[str]:
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    return [" ".join(rng.choices(vocab, k=words)) for _ in range(count)]


def test_lookup_cost_at_100k_indexed_chunks():
    """100,000 chunks of about 350 characters; a prompt of about 16,000 characters (4K tokens
    of a real tokenizer) holding 8 of them among other text."""
    rng = random.Random(0)
    chunks = synthetic_texts(rng, 100_000, 60)
    index = ChunkIndex()
    index.add(chunks)
    picked = rng.sample(chunks, 8)
    filler = synthetic_texts(rng, 8, 280)
    prompt = "Answer from the context.\n\n" + "\n\n".join(
        f"{text}\n\n{other}" for text, other in zip(picked, filler)) + "\n\nQuestion: why?"
    assert 15_000 < len(prompt) < 20_000
    times = []
    for _ in range(21):
        start = time.perf_counter()
        found = index.find(prompt)
        times.append(time.perf_counter() - start)
    assert found == picked
    median = statistics.median(times)
    print(f"\nlookup of 8 chunks in a {len(prompt)}-character prompt among 100,000 indexed: "
          f"median {median * 1000:.2f} ms")
    assert median < 0.05  # about 1.5 ms on one core; generous for a loaded machine
