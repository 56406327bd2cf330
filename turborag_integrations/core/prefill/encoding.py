"""Learned chunk encoding: parameters that act only while a chunk's KV is computed, offline.

A stitched chunk was encoded alone, so its keys and values differ from those a full prefill
computes for the same tokens (it never saw the text before it). Instead of changing the model —
which changes every answer, full prefill included, and ties the blobs to weights no stock engine
serves — what is learned here shapes only how a chunk is *encoded*. At query time the model is the
user's unmodified model; only the chunks' stored KV differ.

Two kinds of parameters, either or both in one file:

- soft tokens: `m` trainable input embeddings placed after the anchor and before every chunk
  (KV Packet / APE-style). Only the chunk attends to them, and their KV is dropped with the
  anchor's, so a blob still holds exactly the chunk's own tokens.
- an encode-only LoRA: low-rank deltas on the projections, active while the anchor, the soft
  tokens and the chunk are computed at ingestion, never for any other token.

Both are trained with no labels (training/distill.py): the teacher is the same model's full
causal prefill, the student the same model over stitched chunks, and the loss the divergence of
their next-token distributions over the reply.

The file (safetensors, `FORMAT`) records the digests of the weights and tokenizer it was trained
for and the anchor it was trained after; a mismatch is refused before any blob is written. Its
content digest is part of every blob's fingerprint (invariant 7): blobs of two encoders never mix.

    enc = LearnedEncoding.load("smollm2-135m-instruct.safetensors")
    with enc.active(model):            # LoRA on for every token of this forward
        model(inputs_embeds=enc.embed(model, ids, soft_at=a), ...)
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .. import environment
from ..errors import EncoderMismatch
from ..tensorfile import read_tensors, save_tensors
from ..transformers_api import PASSIVE_HOOK

FORMAT = "turborag-encoder/1"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LearnedEncoding:
    """Soft tokens [m, hidden] (or None) and encode-only LoRA deltas {module: (A, B, scale)}."""

    soft: torch.Tensor | None = None
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    base_weights: str = ""  # weights digest of the model it was trained for
    tokenizer: str = ""  # tokenizer digest (Fingerprint.tokenizer)
    anchor: str = "chat"  # the anchor spec it was trained after
    meta: dict = field(default_factory=dict)
    name: str = ""  # where it came from, for messages

    @property
    def num_soft(self) -> int:
        return 0 if self.soft is None else int(self.soft.shape[0])

    def digest(self) -> str:
        """Content address of what the parameters compute (not of the file's metadata)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{FORMAT}|{self.anchor}|".encode())
        tensors = {"soft": self.soft} if self.soft is not None else {}
        for name, (a, b, scale) in self.lora.items():
            tensors[f"{name}.A"], tensors[f"{name}.B"] = a, b
            h.update(f"{name}:{float(scale)!r}|".encode())
        for name in sorted(tensors):
            t = tensors[name].detach().to("cpu", torch.float32).contiguous()
            h.update(name.encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    @property
    def tag(self) -> str:
        """The fingerprint-encoding suffix of blobs made with these parameters."""
        return f"enc:{self.num_soft}:{len(self.lora)}:{self.digest()}"

    # ---- checks -----------------------------------------------------------------------------
    def check_model(self, weights: str, tokenizer: str, anchor: str) -> None:
        """Refuse (EncoderMismatch) use with a model, tokenizer or anchor it was not made for."""
        where = self.name or "this encoder"
        if self.base_weights != weights:
            raise EncoderMismatch(
                f"{where} was trained for other model weights (weights {self.base_weights[:12]}, "
                f"base model {self.meta.get('base_model', '?')}); this model's weights are "
                f"{weights[:12]}. Use the encoder made for this model, or encoder=None.")
        if self.tokenizer != tokenizer:
            raise EncoderMismatch(f"{where} was trained with another tokenizer "
                                  f"({self.tokenizer[:12]}, this one {tokenizer[:12]}); use the "
                                  "encoder made for this tokenizer, or encoder=None.")
        if self.anchor != anchor:
            raise EncoderMismatch(f"{where} was trained after the anchor {self.anchor!r}, the "
                                  f"engine encodes after {anchor!r}: pass anchor="
                                  f"{self.anchor!r}, or encoder=None.")

    # ---- the forward ------------------------------------------------------------------------
    def embed(self, model, input_ids: torch.Tensor, soft_at: torch.Tensor | None) -> torch.Tensor:
        """Input embeddings [B, T, hidden] of `input_ids` with the soft tokens written over the
        `num_soft` slots starting at each row's `soft_at` (int64 [B]; None: no soft tokens)."""
        emb = model.get_input_embeddings()(input_ids)
        if self.soft is None or soft_at is None:
            return emb
        soft = self.soft.to(device=emb.device, dtype=emb.dtype)
        m = self.num_soft
        rows = torch.arange(input_ids.shape[0], device=emb.device)[:, None]
        cols = soft_at.to(emb.device)[:, None] + torch.arange(m, device=emb.device)[None, :]
        # out of place: autograd must see the soft tokens replace the placeholder embeddings
        emb = emb.index_put((rows.expand(-1, m), cols), soft.expand(input_ids.shape[0], -1, -1))
        return emb

    @contextmanager
    def active(self, model, token_mask: torch.Tensor | None = None) -> Iterator[None]:
        """The LoRA deltas on while the block runs, in this thread only: on every token, or —
        with `token_mask` ([B, T], 1 where a token is encoded as part of a chunk) — on those
        tokens only, as the training forward of a whole stitched prompt needs.

        The hooks stay installed on the model but act only for a thread inside this block, so a
        chunk encoded on one thread never leaks its deltas into a prompt another thread is
        answering with the same model at the same moment."""
        if not self.lora:
            yield
            return
        _install_hooks(model, self.lora, self.name)
        previous = getattr(_ACTIVE, "state", None)
        _ACTIVE.state = (self, token_mask, {})
        try:
            yield
        finally:
            _ACTIVE.state = previous

    # ---- the file ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the file atomically (float32 tensors: small, and exactly what was trained)."""
        tensors = {}
        scales = {}
        if self.soft is not None:
            tensors["soft"] = self.soft.detach().to("cpu", torch.float32).contiguous()
        for name, (a, b, scale) in self.lora.items():
            tensors[f"{name}.lora_A"] = a.detach().to("cpu", torch.float32).contiguous()
            tensors[f"{name}.lora_B"] = b.detach().to("cpu", torch.float32).contiguous()
            scales[name] = float(scale)
        if not tensors:
            raise ValueError("an encoder needs soft tokens, LoRA deltas or both")
        header = {"format": FORMAT, "base_weights": self.base_weights,
                  "tokenizer": self.tokenizer, "anchor": self.anchor,
                  "scales": json.dumps(scales), "meta": json.dumps(self.meta)}
        return save_tensors(path, tensors, header)

    @classmethod
    def load(cls, path: str | Path) -> "LearnedEncoding":
        path = Path(path)
        header, tensors = read_tensors(path, FORMAT, "encoder", EncoderMismatch)
        try:
            scales = json.loads(header.get("scales", "{}"))
            meta = json.loads(header.get("meta", "{}"))
            lora = {name: (tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], float(s))
                    for name, s in scales.items()}
        except (KeyError, ValueError) as exc:
            raise EncoderMismatch(f"{path}: incomplete encoder file ({exc})") from None
        return cls(soft=tensors.get("soft"), lora=lora, base_weights=header.get("base_weights", ""),
                   tokenizer=header.get("tokenizer", ""), anchor=header.get("anchor", "chat"),
                   meta=meta, name=str(path))


_ACTIVE = threading.local()  # .state: (encoding, token mask, per-call cast cache) or None
_HOOKED = "_turborag_encoder_hooks"  # attribute on a model: names of modules with our hook


def _install_hooks(model, lora: dict, where: str) -> None:
    """Once per module: a forward hook that adds the active encoding's delta, if any."""
    hooked = getattr(model, _HOOKED, None)
    if hooked is None:
        hooked = set()
        setattr(model, _HOOKED, hooked)
    missing = [name for name in lora if name not in hooked]
    if not missing:
        return
    modules = dict(model.named_modules())
    for name in missing:
        if name not in modules:
            raise EncoderMismatch(f"{where or 'the encoder'} targets {name}, which this model "
                                  "does not have")
    with _HOOK_LOCK:
        for name in missing:
            if name not in hooked:
                modules[name].register_forward_hook(_delta_hook(name))
                hooked.add(name)


_HOOK_LOCK = threading.Lock()


def _delta_hook(name: str):
    def hook(module, args, out):
        state = getattr(_ACTIVE, "state", None)
        if state is None:
            return out
        enc, token_mask, cast = state
        factors = enc.lora.get(name)
        if factors is None:
            return out
        a, b, scale = factors
        x = args[0]
        if a.requires_grad:  # training: the parameters themselves, in the forward's dtype
            aa, bb = a.to(x.dtype), b.to(x.dtype)
        else:  # inference: cast once per block, device and dtype
            key = (name, x.device, x.dtype)
            if key not in cast:
                cast[key] = (a.to(device=x.device, dtype=x.dtype),
                             b.to(device=x.device, dtype=x.dtype))
            aa, bb = cast[key]
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, aa), bb) * float(scale)
        if token_mask is not None:
            delta = delta * token_mask.to(device=x.device, dtype=x.dtype)[..., None]
        return out + delta

    setattr(hook, PASSIVE_HOOK, True)  # inert outside `active`: fast decoding may skip it
    return hook


def new_lora(model, rank: int, targets=LORA_TARGETS, *, seed: int = 0,
             alpha: float | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Fresh trainable LoRA factors for every Linear named in `targets`: A small random, B zero,
    so training starts from the training-free encoding exactly."""
    gen = torch.Generator().manual_seed(seed)
    scale = (alpha if alpha is not None else 2 * rank) / rank
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=gen) / module.in_features ** 0.5
            b = torch.zeros(module.out_features, rank)
            out[name] = (a.requires_grad_(), b.requires_grad_(), scale)
    return out


def resolve_encoder(spec, model_name: str, weights: str | None = None) -> LearnedEncoding | None:
    """`encoder=` of the engine: None / "none" (training-free encoding), "default" (the file
    shipped for a bundled model, if any), a path, or a LearnedEncoding.

    "default" finds a bundled model's file by its name, or, for a model loaded from a folder
    (vLLM's connector loads the bundled model's converted folder), by the `weights` digest the
    file was trained for: the same weights get the same encoder however they were loaded."""
    if spec is None or spec == "none":
        return None
    if isinstance(spec, LearnedEncoding):
        return spec
    if spec == "default":
        path = bundled_encoder(model_name)
        if path is not None:
            return LearnedEncoding.load(path)
        if weights is not None:
            for name in BUNDLED:
                path = bundled_encoder(name)
                found = LearnedEncoding.load(path) if path is not None else None
                if found is not None and found.base_weights == weights:
                    return found
        return None
    path = Path(spec)
    if not path.exists():
        named = bundled_encoder(str(spec))
        if named is not None:
            return LearnedEncoding.load(named)
    return LearnedEncoding.load(path)


BUNDLED = {"smollm2-135m-instruct": "smollm2-135m-instruct.safetensors"}  # under data/encoders/


def bundled_encoder(model_name: str) -> Path | None:
    """The encoder file shipped for a bundled model, or None."""
    return environment.bundled_file("encoders", BUNDLED.get(model_name))
