"""The separators templates put between retrieved chunks, as the tokens a whole prompt gives them.

An engine that fills a prompt front to back (vLLM's connector interface) can take stored KV only
for a run that starts the prompt, so the "\\n\\n" a template puts between two chunks would end the
run at the first chunk. Stored like a chunk — encoded alone after the anchor — a separator lets
the run go on: `[head][chunk][sep][chunk]…`. Such a separator sees only itself, where the HF
engine prefills it with the question, attending to the chunks before it; this is the one way
stitching on vLLM differs from the HF engine (docs/vllm.md).

A separator's tokens depend on its neighbours ("\\n\\n" alone is one token in SmolLM2's
vocabulary, between two words it is two), so the ids kept are those it gets between typical chunk
edges, in a tokenization of the whole text.
"""

from __future__ import annotations

from typing import Sequence

# what LlamaIndex ("\n\n".join), LangChain's stuff chains and common prompts put between chunks
STOCK_SEPARATORS = ("\n\n", "\n", "\n\n\n", " ", "\n\n---\n\n")
# chunk edges around them: a sentence end, a word, a heading, a bracketed source tag
_EDGES = (("end.", "Next"), ("end", "The"), ("end.", "[Document"), ("end.", "# Title"),
          ("end.", "1."), ("end.\n", "Next"))
MAX_SEPARATOR_TOKENS = 4


def separator_ids(tokenizer, separators: Sequence[str] = STOCK_SEPARATORS) -> list[list[int]]:
    """The distinct token-id runs the separators take between chunk edges (at most
    MAX_SEPARATOR_TOKENS long), where the whole text tokenizes as edge + run + edge."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    found: dict[tuple[int, ...], None] = {}
    for sep in separators:
        for left, right in _EDGES:
            a, b, whole = ids(left), ids(right), ids(left + sep + right)
            if whole[:len(a)] == a and whole[len(whole) - len(b):] == b:
                run = tuple(whole[len(a):len(whole) - len(b)])
                if 0 < len(run) <= MAX_SEPARATOR_TOKENS:
                    found[run] = None
    return [list(run) for run in found]
