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
