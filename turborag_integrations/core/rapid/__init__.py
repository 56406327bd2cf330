"""RAPID: a drafter reading retrieved chunks, a long-context target verifying its drafts.

speculation (rounds over two sides) → context (the drafter's chunks) → engine (`RapidEngine`,
the facade over two TurboRAGEngines). The names below were importable from
`turborag_integrations.core.rapid` when it was one module; the acceptance math they re-export
lives in `core.decode.sampling`.
"""

from ..decode.sampling import (TAIL_RATIO, AcceptRule, Verdict, accept_drafts, augmented_probs,
                               first_token, residual_probs)
from ..settings import RESIDUALS, SpeculationConfig
from .context import ContextIndex, DrafterContext, document_order
from .engine import (REFERENCE_CONTEXT, RapidEngine, RapidResult, RapidStats, VocabularyMismatch,
                     check_same_vocabulary, default_template, split_question, target_greedy)
from .speculation import Round, Side, check_speculation, speculate

__all__ = ["RapidEngine", "REFERENCE_CONTEXT", "check_speculation", "RapidResult", "RapidStats", "VocabularyMismatch", "SpeculationConfig",
           "check_same_vocabulary", "default_template", "split_question", "target_greedy",
           "Side", "Round", "speculate", "ContextIndex", "DrafterContext", "document_order",
           "accept_drafts", "augmented_probs", "residual_probs", "first_token", "Verdict",
           "AcceptRule", "TAIL_RATIO", "RESIDUALS"]
