"""One-token decode steps without the per-step overhead of a full transformers forward.

A stock decode step (`model(input_ids=[[tok]], position_ids=[[pos]], cache=...)`) spends most of
its time reading weights (≈540 MB fp32 for SmolLM2-135M, of which the 49K × 576 lm_head is 113 MB)
and the KV cache; the rest is Python: argument handling, output capture, building a causal mask
that for a single query is "attend to everything", dataclass outputs. `FastDecoder` runs the same
step by calling the model's own submodules and functions in the same order (embedding, rotary
embedding, RMSNorm modules, transformers' `apply_rotary_pos_emb`, the cache's `update`, the
attention function transformers would pick, `act_fn`), with the Linear layers applied to their own
weights. No transformers module is patched: the fast path only reads the model.

How each Linear layer is applied — F.linear, a duplicated-row matrix product, or an int8 or
bf16 copy of its weights — is core/decode/matmul.py's.

The KV cache stays in the model's dtype and attention is unchanged; prefill stays in full
precision, so only decoded tokens see the reduced-precision weights. To keep full-precision
answers, use the quantised copy as a drafter instead (core/decode/selfspec.py).

Architectures outside the llama family (llama, mistral, qwen2 without sliding layers), attention
implementations other than sdpa/eager, models with forward hooks (accelerate offloading, an
adapter's; not the learned chunk encoder's, which are inert outside encoding:
`transformers_api.PASSIVE_HOOK`) and models in training mode get `None` from
`FastDecoder.for_model`; callers then use the stock forward.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import environment
from ..settings import QUANTIZE_MODES, check_choice
from ..attention import split_attention
from ..transformers_api import is_passive_hook, with_cache
from .matmul import (MATMUL_MODES, VERIFY_ROWS, Bf16Linear, gemm, int8_available, int8_linear,
                     pick_matmul)

log = logging.getLogger(__name__)

INT8_PARTS = ("qkv", "o", "gate_up", "down", "lm_head")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ATTENTION = ("sdpa", "eager")

_decoders: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def unsupported_reason(model) -> str | None:
    """Why the fast path cannot run `model` (None when it can)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "_attn_implementation", None) not in _ATTENTION:
        return f"attention implementation {config._attn_implementation!r} is not one of {_ATTENTION}"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window layers"
    if not getattr(config, "is_causal", True):
        return "not a causal model"
    if model.training:
        return "model in training mode"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "unexpected module layout"
    if not isinstance(model.lm_head, torch.nn.Linear):
        return "lm_head is not a Linear"
    for module in model.modules():
        if hasattr(module, "_hf_hook"):
            return "module hooks (offloading or adapters)"
        if not (module._forward_hooks or module._forward_pre_hooks):
            continue  # most modules: no hook to look at (this check runs at each admission)
        hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
        # the learned chunk encoder's hooks are inert outside its encoding block (PASSIVE_HOOK)
        if any(not is_passive_hook(h) for h in hooks):
            return "module hooks (offloading or adapters)"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(isinstance(getattr(attn, n, None), torch.nn.Linear) for n in names):
            return "attention projections are not Linear layers"
        if not all(isinstance(getattr(mlp, n, None), torch.nn.Linear)
                   for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP projections are not Linear layers"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "query/key norms"
    return None


class _Layer:
    __slots__ = ("idx", "ln1", "ln2", "q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up",
                 "act", "attn", "rotary_fn")


class FastDecoder:
    """Runs one-token decode steps of a llama-family model; see the module docstring."""

    def __init__(self, model, quantize: str | None = None, *, skip: tuple[str, ...] = (),
                 matmul: str = "auto"):
        check_choice("quantize", quantize, QUANTIZE_MODES)
        check_choice("matmul", matmul, MATMUL_MODES)
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast decoding does not support this model: {reason}")
        if quantize is not None:
            if quantize == "int8" and not int8_available():
                raise RuntimeError("int8 dynamic quantisation is not available in this torch build")
            param = next(model.parameters())
            if param.device.type != "cpu" or param.dtype != torch.float32:
                raise ValueError(f"{quantize} decoding needs a float32 model on CPU")
        self.model = model
        self.quantize = quantize
        # one row (decode steps) and several rows of one sequence (verification forwards)
        # are timed apart: which product is faster differs between the two
        head = (model.lm_head.weight.detach() if quantize != "bf16"
                else model.lm_head.weight.detach().to(torch.bfloat16))
        self.rows_matmul = pick_matmul(head, VERIFY_ROWS) if matmul == "auto" else matmul
        if matmul == "auto":
            matmul = pick_matmul(head)
        self.matmul = matmul
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.num_layers = config.num_hidden_layers
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.layers: list[_Layer] = []
        for i, layer in enumerate(inner.layers[: self.num_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            entry = _Layer()
            entry.idx = i
            entry.ln1, entry.ln2 = layer.input_layernorm, layer.post_attention_layernorm
            entry.attn = attn
            entry.act = mlp.act_fn
            # the very function the stock attention forward calls (module global)
            entry.rotary_fn = sys.modules[type(attn).__module__].apply_rotary_pos_emb
            q8 = set() if quantize is None else set(INT8_PARTS) - set(skip)
            entry.q, entry.k, entry.v, entry.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
            entry.gate, entry.up, entry.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
            entry.qkv = entry.gate_up = None
            make = int8_linear if quantize == "int8" else \
                (lambda w, b: Bf16Linear(w, b, self.matmul))
            if "qkv" in q8:
                entry.qkv = make([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                                 [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            if "o" in q8:
                entry.o = make([attn.o_proj.weight], [attn.o_proj.bias])
            if "gate_up" in q8:
                entry.gate_up = make([mlp.gate_proj.weight, mlp.up_proj.weight],
                                     [mlp.gate_proj.bias, mlp.up_proj.bias])
            if "down" in q8:
                entry.down = make([mlp.down_proj.weight], [mlp.down_proj.bias])
            self.layers.append(entry)
        # what the stock attention forward picks: the registered interface, else the modeling
        # file's own eager function
        modeling = sys.modules[type(inner.layers[0].self_attn).__module__]
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            config._attn_implementation, modeling.eager_attention_forward)
        self.lm_head = model.lm_head
        if quantize is not None and "lm_head" not in skip:
            self.lm_head = (int8_linear([model.lm_head.weight], [model.lm_head.bias])
                            if quantize == "int8" else
                            Bf16Linear([model.lm_head.weight], [model.lm_head.bias],
                                        self.matmul))
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.intermediate = inner.layers[0].mlp.gate_proj.out_features

    # ---- construction, cached per model -----------------------------------------------------
    @classmethod
    def for_model(cls, model, quantize: str | None = None,
                  matmul: str | None = None) -> "FastDecoder | None":
        """The model's decoder (built once per model, mode and matmul), or None if unsupported.

        matmul: "linear" (F.linear: fp32 logits bit-identical to the stock forward), "gemm"
        (see `gemm`: faster on some CPUs, equal up to rounding) or "auto" (whichever is faster
        here, timed once); None reads TURBORAG_DECODE_MATMUL, default "auto".

        Support is checked on every call (a model put in training mode or given hooks falls back
        to the stock forward). int8 decoders hold quantised copies of the weights taken when first
        built: call `FastDecoder.forget(model)` after changing the weights in place.
        """
        check_choice("quantize", quantize, QUANTIZE_MODES)
        matmul = check_choice("matmul (TURBORAG_DECODE_MATMUL)",
                              matmul or environment.decode_matmul(),
                              MATMUL_MODES)
        reason = unsupported_reason(model)
        if reason:
            log.debug("stock decoding: %s", reason)
            return None
        with _lock:
            per_model = _decoders.get(model)
            if per_model is None:
                per_model = _decoders[model] = {}
            decoder = per_model.get((quantize, matmul))
            if decoder is None:
                decoder = per_model[(quantize, matmul)] = cls(model, quantize, matmul=matmul)
        return decoder

    @staticmethod
    def forget(model) -> None:
        """Drop the decoders built for `model` (and their quantised weights)."""
        with _lock:
            _decoders.pop(model, None)

    # ---- steps ------------------------------------------------------------------------------
    def apply(self, x, module, matmul: str | None = None):
        if type(module) is torch.nn.Linear:
            if (matmul or self.matmul) == "gemm":
                return gemm(x, module.weight, module.bias)
            return F.linear(x, module.weight, module.bias)
        return module(x)  # an int8 dynamic-quantised or bf16 Linear

    def hidden(self, tokens: Sequence[int], position: int, cache) -> torch.Tensor:
        """The final-norm hidden states [1, k, hidden] of `tokens` fed at `position`,
        `position + 1`, ...; appends their keys/values to every layer of `cache`.

        One token attends to the whole cache through the attention function transformers
        would pick (no mask, as in a stock decode step). Several tokens attend to the cache and,
        causally, to each other through RAPID's split attention (core/attention.py),
        which needs no mask either.
        """
        device = self.embed.weight.device
        n = len(tokens)
        ids = torch.tensor([list(tokens)], device=device)
        position_ids = torch.arange(position, position + n, device=device)[None]
        attention = self.attention

        def attend(L, q, k, v):
            k, v = cache.update(k, v, L.idx)
            if n == 1:
                return attention(L.attn, q, k, v, None, dropout=0.0, scaling=L.attn.scaling)[0]
            return split_attention(q, k, v, L.attn.scaling).transpose(1, 2)

        return self.run_layers(ids, position_ids, attend)

    def run_layers(self, ids: torch.Tensor, position_ids: torch.Tensor, attend,
                   apply=None) -> torch.Tensor:
        """The final-norm hidden states [b, n, hidden] of token ids [b, n] at `position_ids`
        [b, n], through every decoder layer.

        `attend(layer, q, k, v)` gets the rotated queries [b, heads, n, dim] and keys/values
        [b, kv_heads, n, dim] of one layer, stores the keys/values and returns the attention
        output [b, n, heads, dim]: the one part that depends on where the cache lives (one
        cache for `hidden`, one cache per row for a batched step). `apply(x, linear)` replaces
        the Linear product (a batched step's packed weights, core/decode/packed.py).
        """
        h = self.embed(ids)
        b, n = ids.shape
        cos, sin = self.rotary(h, position_ids)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        split_qkv = (self.q_size, self.kv_size, self.kv_size)
        split_mlp = (self.intermediate, self.intermediate)
        if apply is None and n > 1 and self.rows_matmul != self.matmul:  # tokens of one sequence
            def apply(x, module, _matmul=self.rows_matmul):
                return self.apply(x, module, _matmul)
        apply = apply or self.apply
        for L in self.layers:
            residual = h
            x = L.ln1(h)
            if L.qkv is not None:
                q, k, v = L.qkv(x).split(split_qkv, dim=-1)
            else:
                q, k, v = apply(x, L.q), apply(x, L.k), apply(x, L.v)
            q = q.view(b, n, heads, dim).transpose(1, 2)
            k = k.view(b, n, kv_heads, dim).transpose(1, 2)
            v = v.view(b, n, kv_heads, dim).transpose(1, 2)
            q, k = L.rotary_fn(q, k, cos, sin)
            a = attend(L, q, k, v)
            h = residual + apply(a.reshape(b, n, -1).contiguous(), L.o)
            residual = h
            x = L.ln2(h)
            if L.gate_up is not None:
                gate, up = L.gate_up(x).split(split_mlp, dim=-1)
            else:
                gate, up = apply(x, L.gate), apply(x, L.up)
            h = residual + apply(L.act(gate) * up, L.down)
        return self.norm(h)

    def step(self, token: int, position: int, cache) -> torch.Tensor:
        """Logits [vocab] of the next token after feeding `token` at `position`."""
        return self.apply(self.hidden((token,), position, cache), self.lm_head)[0, -1]

    __call__ = step

    def forward(self, tokens: Sequence[int], position: int, cache) -> torch.Tensor:
        """Logits [k, vocab] after each of `tokens` fed from `position` (a verification)."""
        matmul = self.rows_matmul if len(tokens) > 1 else self.matmul
        return self.apply(self.hidden(tokens, position, cache), self.lm_head, matmul)[0]


def stock_step(model, token: int, position: int, cache) -> torch.Tensor:
    """The same step through the model's own forward (the reference, and the fallback)."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([[token]], device=device),
                position_ids=torch.tensor([[position]], device=device),
                **with_cache(cache), use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]
