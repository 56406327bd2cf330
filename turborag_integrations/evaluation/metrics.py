"""Answer metrics: exact match, token F1 (SQuAD-style normalisation) and answer-contains."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalize(text: str) -> str:
    """Lower case, punctuation to spaces, articles dropped, whitespace collapsed."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    p = normalize(prediction)
    return float(any(p == normalize(a) for a in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    pred = normalize(prediction).split()
    best = 0.0
    for a in answers:
        gold = normalize(a).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        if common == 0:
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains(prediction: str, answers: Sequence[str]) -> float:
    """1 when a normalised answer occurs in the normalised prediction as whole words."""
    p = f" {normalize(prediction)} "
    return float(any(normalize(a) and f" {normalize(a)} " in p for a in answers))


def score(prediction: str, answers: Sequence[str]) -> dict[str, float]:
    return {"em": exact_match(prediction, answers), "f1": token_f1(prediction, answers),
            "contains": contains(prediction, answers)}


# A reply that declines to answer: what a RAG model should say when the context lacks the fact.
# Matched on the normalised reply (lower case, no punctuation, no articles).
_REFUSAL = re.compile(
    r"\b(not (mentioned|stated|specified|given|provided|included|say|said|found|available|known|clear"
    r"|contain|contained|in (context|text|passage|documents?))"
    r"|(does not|doesn t|do not|don t|did not|cannot|can not|can t|unable to) "
    r"(say|state|mention|specify|know|tell|answer|find|determine|provide)"
    r"|(cannot|can not|can t) be (determined|answered|found)"
    r"|no (information|mention|answer|data|details?)"
    r"|unknown|i don t know|there is no)\b")


def is_refusal(reply: str) -> bool:
    """True when the reply says the context does not hold the answer (English phrasings)."""
    return bool(_REFUSAL.search(normalize(reply)))
