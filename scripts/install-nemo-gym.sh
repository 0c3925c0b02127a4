#!/usr/bin/env bash
# Creates (or reuses) the virtual environment that the NeMo Gym interop tests (tests/interop/) run in.
# NeMo Gym declares Python >=3.13.14, but its sandbox and telemetry modules import and run on 3.11;
# it is installed without its dependencies, never as a dependency of this project. The venv lives
# outside the checkout, keyed by the NeMo Gym version and the Python that builds it:
#   ${NEMO_GYM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-sandbox-middleware/nemo-gym-$NEMO_GYM_VERSION-py$X.Y}
# This checkout is installed into it editable (with its test extra) on every run, so the venv
# follows the working tree. Prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
NEMO_GYM_VERSION="${NEMO_GYM_VERSION:-0.7.0}"
python="${NEMO_GYM_BASE_PYTHON:-python3}"
py_version="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
venv="${NEMO_GYM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-sandbox-middleware/nemo-gym-$NEMO_GYM_VERSION-py$py_version}"
marker="$venv/.complete"
if [ ! -f "$marker" ]; then
  echo "installing nemo-gym==$NEMO_GYM_VERSION (no dependencies) into $venv" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  # NeMo Gym itself without its dependencies (they would pull its whole server stack); the three
  # libraries its sandbox and telemetry modules import (orjson, for token_id_capture, below), with theirs (pydantic needs pydantic-core).
  "$venv/bin/python" -m pip install --quiet --no-deps --ignore-requires-python "nemo-gym==$NEMO_GYM_VERSION" >&2
  "$venv/bin/python" -m pip install --quiet pydantic omegaconf pyyaml >&2
  touch "$marker"
fi
# orjson: NeMo Gym's token_id_capture (records, lineage, conformance suite) imports it, and its servers
# parse responses with it (server_utils.py: bench/tokens_bench.py's side-by-side run); a venv made
# before it was needed gets it here.
"$venv/bin/python" -c "import orjson" 2>/dev/null || "$venv/bin/python" -m pip install --quiet orjson >&2
# pip's resolver lists NeMo Gym's dependencies left out on purpose on every install: keep only other lines.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! "$venv/bin/python" -m pip install --quiet -e '.[test]' >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
grep -v "^nemo-gym .* requires \|dependency resolver does not currently" "$log" >&2 || true
"$venv/bin/python" -c "import nemo_gym.sandbox, nemo_gym.telemetry, sandbox_middleware" >&2
echo "$venv/bin/python"
