"""Re-rotate cached keys by a position offset.

A RoPE key at position p is R(p)·k, where R(p) rotates each frequency pair by p·θ_i. Rotations
compose, so R(d)·R(p)·k = R(p+d)·k: a chunk encoded alone at positions 0..n−1 is moved to
d..d+n−1 by rotating its keys by d, with no need for the pre-RoPE keys. This holds whenever the
frequencies θ_i do not depend on the position or the sequence length, which is why only some RoPE
variants are accepted here.

Some variants also multiply cos and sin by a constant (YaRN's attention factor s): a cached key is
then s·R(p)·k. The rotation here is the unscaled R(d), so R(d)·s·R(p)·k = s·R(p+d)·k, exactly the
key a full prefill computes at p+d; applying s again would scale the key twice.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedRopeError

# Variants whose inverse frequencies are fixed for a given config (llama3, linear and yarn rescale
# them once, up front; yarn's attention factor is a constant already inside the cached keys, see
# above). "dynamic" rescales them with the sequence length; it is exact only while every position
# stays within the original window, which `KeyRotator.check_length` checks.
EXACT_ROPE_TYPES = frozenset({"default", "llama3", "linear", "yarn"})
CONDITIONAL_ROPE_TYPES = frozenset({"dynamic"})
SUPPORTED_ROPE_TYPES = EXACT_ROPE_TYPES | CONDITIONAL_ROPE_TYPES

# Why the known variants that are not supported cannot be re-rotated.
REFUSAL_REASONS = {
    "longrope": "LongRoPE switches every frequency between its short and long factors according "
                "to the length of the whole sequence (beyond original_max_position_embeddings "
                "it uses the long ones), so a chunk's keys, encoded alone, carry rotations a full "
                "prompt of another length would not give them",
}


def rope_type_of(config) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        # Per-layer-type parameters (e.g. {"full_attention": {...}}): not a layout we support.
        raise UnsupportedRopeError(f"per-layer RoPE parameters are not supported: {params}")
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        reason = REFUSAL_REASONS.get(rope_type, "its frequencies or scaling depend on the "
                                                "position or the sequence length")
        raise UnsupportedRopeError(
            f"RoPE type {rope_type!r} cannot be re-rotated exactly: {reason}. Use a model with "
            f"one of the supported RoPE types: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


class KeyRotator:
    """Rotates post-RoPE keys of one model by an offset, in float32 like transformers does."""

    def __init__(self, inv_freq: torch.Tensor, rope_type: str = "default",
                 original_max_positions: int | None = None):
        self.inv_freq = inv_freq.detach().to(torch.float32)
        self.rope_type = rope_type
        self.original_max_positions = original_max_positions

    @classmethod
    def for_model(cls, model) -> "KeyRotator":
        rope_type = rope_type_of(model.config)
        rotary = model.model.rotary_emb
        # original_inv_freq: dynamic RoPE overwrites inv_freq in place once a long input is seen.
        inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq)
        original = getattr(rotary, "original_max_seq_len", None)
        return cls(inv_freq, rope_type, original)

    @classmethod
    def for_config(cls, config) -> "KeyRotator":
        """The rotator of a model known only by its config (an engine that holds its own
        weights, such as vLLM): the inverse frequencies are computed as transformers computes
        them, with no module built."""
        rope_type = rope_type_of(config)
        params = getattr(config, "rope_parameters", None) or {}
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = getattr(config, "head_dim", None) or \
                config.hidden_size // config.num_attention_heads
            dim = int(dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        original = params.get("original_max_position_embeddings") \
            or getattr(config, "max_position_embeddings", None)
        return cls(inv_freq, rope_type, original)

    def check_length(self, total_positions: int) -> None:
        """Refuse dynamic RoPE when positions 0..total_positions−1 leave its original window.

        Count the prompt's positions and one per new token. transformers rescales dynamic RoPE
        once a forward's largest position p has p + 1 > the original window, so a window of W
        positions fits exactly W: a W-token total runs, W + 1 is refused.
        """
        if self.rope_type in CONDITIONAL_ROPE_TYPES and self.original_max_positions \
                and total_positions > self.original_max_positions:
            raise UnsupportedRopeError(
                f"dynamic RoPE rescales its frequencies beyond {self.original_max_positions} "
                f"positions, so cached keys cannot be re-rotated for {total_positions} positions "
                "(prompt and new tokens); shorten the prompt, ask for fewer new tokens, or use a "
                f"model with one of the RoPE types {sorted(EXACT_ROPE_TYPES)}"
            )

    def cos_sin(self, offset: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        angles = float(offset) * self.inv_freq.to(device)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(self, keys: torch.Tensor, offset: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate keys [..., head_dim] by `offset` positions; write into `out` when given.

        Same pairing as transformers' rotate_half: dimension i pairs with i + head_dim/2. In
        float32 the result is written straight into `out` with no temporaries: assembly time
        is mostly this function.
        """
        if out is None:
            out = torch.empty_like(keys)
        if offset == 0:
            return out.copy_(keys)
        half = keys.shape[-1] // 2
        cos, sin = self.cos_sin(offset, keys.device)
        if keys.dtype == torch.float32 and out.dtype == torch.float32:
            k1, k2 = keys[..., :half], keys[..., half:]
            o1, o2 = out[..., :half], out[..., half:]
            torch.mul(k1, cos, out=o1)
            o1.addcmul_(k2, sin, value=-1.0)
            torch.mul(k2, cos, out=o2)
            o2.addcmul_(k1, sin)
            return out
        k = keys.to(torch.float32)
        k1, k2 = k[..., :half], k[..., half:]
        return out.copy_(torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1))
