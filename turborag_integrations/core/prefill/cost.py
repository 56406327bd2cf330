"""Whether stitching a prompt pays: its stitched prefill against a full prefill of its tokens.

Where a prompt's chunks have no blob (a cold store, a hot set warming up: core/admission.py),
their tokens are prefilled as plain rows of the stitched forward, and a query-aware recovery
prefills them twice (its probe, then the forward after it). Past a share of such rows a full
prefill of the whole prompt is faster — and it is the exact answer besides. The engine then runs
one (`TurboRAGEngine.start`, `stats.extra["full_prefill"]`).
"""

from __future__ import annotations

from .recovery import NO_RECOVERY, Recovery
from .stitch import StitchPlan

# A stitched forward's plain rows cost more than a causal prefill's (their attention runs block by
# block under a mask: 2.9 ms a row against 2.1 at 4K tokens, SmolLM2 on a 2-core CPU).
STITCHED_ROW_COST = 1.4


def stitching_pays(plan: StitchPlan, recovery: Recovery | None) -> bool:
    """Whether prefilling `plan` stitched (with `recovery`) costs less than a full prefill of
    its tokens. Where chunks have no blob (a cold store, a hot set still warming up), their
    tokens are plain rows: prefilled once by a query-aware recovery's probe and again after it,
    each row dearer than a causal one. Measured (SmolLM2, 6 × 256-token chunks): one chunk in
    six without a blob, 1.7 s against the full prefill's 2.5 s; two, 2.7 s; five, 7.8 s. The
    rule, in rows of full-prefill work: STITCHED_ROW_COST × (plain × (1 + probe) + recomputed)
    against the prompt's tokens."""
    plain, cached = plan.prefilled_tokens, plan.reused_tokens
    if not cached:
        return False
    recovery = recovery or NO_RECOVERY
    work = plain * (2 if recovery.probes() else 1) + recovery.recomputed_share() * cached
    return STITCHED_ROW_COST * work < plain + cached
