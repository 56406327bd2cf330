"""The two spellings of a model's KV cache argument across the transformers releases we run on.

transformers renamed `past_key_values` to `cache` (argument and output field) during 5.x; vLLM's
venv pins an older 5.x than the package's own. Every forward that passes or reads a cache goes
through these two names, decided once from the installed release.
"""

from __future__ import annotations

import inspect


def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
        else "past_key_values"


CACHE_KWARG = _cache_kwarg()


def with_cache(cache) -> dict:
    """`model(..., **with_cache(c))`: the cache under this release's argument name."""
    return {CACHE_KWARG: cache}


def output_cache(out):
    """The cache a forward returned, under either field name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


# Set on a forward hook that acts only inside a block which turns it on, on the thread that runs
# the block (the learned chunk encoder's LoRA deltas: core/prefill/encoding.py). Outside such a
# block the module computes exactly its stock output, so a fast path that reads the weights
# directly (core/decode/fast.py) may ignore the hook; any other hook makes it step aside.
PASSIVE_HOOK = "_turborag_passive_hook"


def is_passive_hook(hook) -> bool:
    return bool(getattr(hook, PASSIVE_HOOK, False))
