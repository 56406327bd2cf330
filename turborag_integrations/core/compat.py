"""Old module paths of the core, kept importable (with a DeprecationWarning) after it was grouped
into the prefill, decode, retrieval, rapid and store subpackages.

`import turborag_integrations.core.stitch` still works and gives the very module now at
`turborag_integrations.core.prefill.stitch`; a module whose contents were split gets a module
holding the public names of all its parts. Installed by `core/__init__.py`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

PACKAGE = __name__.rpartition(".")[0]  # turborag_integrations.core

# old name under core → the module(s) its contents live in now
MOVED: dict[str, tuple[str, ...]] = {
    "rope": ("prefill.rope",), "anchor": ("prefill.anchor",), "blob": ("prefill.blob",),
    "cache": ("prefill.cache",), "segment": ("prefill.segment",),
    "stitch": ("prefill.stitch",), "recovery": ("prefill.recovery",),
    "rapid_attention": ("attention",), "selfspec": ("decode.selfspec",),
    "generate": ("decode.loop", "decode.sampling", "settings", "run"),
    "chunking": ("retrieval.chunking",), "embedding": ("retrieval.embedding",),
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix == PACKAGE and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        name = spec.name.rpartition(".")[2]
        parts = [f"{PACKAGE}.{p}" for p in MOVED[name]]
        warnings.warn(f"{spec.name} moved to {', '.join(parts)}; import it from there",
                      DeprecationWarning, stacklevel=2)
        if len(parts) == 1:
            return importlib.import_module(parts[0])
        module = types.ModuleType(spec.name, f"Moved to {', '.join(parts)}.")
        for part in parts:
            source = importlib.import_module(part)
            module.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("_")})
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
