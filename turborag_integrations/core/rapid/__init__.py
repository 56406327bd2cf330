"""RAPID: a drafter reading retrieved chunks, a long-context target verifying its drafts.

speculation (rounds over two sides) → context (the drafter's chunks) → engine (`RapidEngine`,
the facade over two TurboRAGEngines). The acceptance math (`accept_drafts`, the augmented
target distribution) is decoding's, in `core.decode.sampling`, shared with self-speculation.
"""

from ..settings import SpeculationConfig
from .config import RapidConfig
from .context import ContextIndex, DrafterContext, document_order
from .engine import (REFERENCE_CONTEXT, RapidEngine, RapidResult, RapidStats, VocabularyMismatch,
                     check_same_vocabulary, default_template, split_question, target_greedy)
from .speculation import Round, Side, speculate

__all__ = ["RapidEngine", "RapidConfig", "REFERENCE_CONTEXT", "RapidResult", "RapidStats",
           "VocabularyMismatch", "SpeculationConfig", "check_same_vocabulary", "default_template",
           "split_question", "target_greedy", "Side", "Round", "speculate", "ContextIndex",
           "DrafterContext", "document_order"]
