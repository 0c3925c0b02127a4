#!/usr/bin/env bash
# Installs (or reuses) the real agents the capture proxy's agent tests run: OpenAI's Codex CLI and
# Anthropic's Claude Code, pinned, from npm, into a prefix outside the checkout keyed by their versions:
#   ${AGENTS_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-sandbox-middleware/agents-codex-$CODEX_VERSION-claude-$CLAUDE_CODE_VERSION}
# Needs Node.js 18+ and npm (apt-get install -y nodejs npm). Prints the folder holding the `codex` and
# `claude` commands on its last line (tests/tokens/proxy/agents.py reads it from AGENTS_BIN).
set -euo pipefail
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"
prefix="${AGENTS_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-sandbox-middleware/agents-codex-$CODEX_VERSION-claude-$CLAUDE_CODE_VERSION}"
marker="$prefix/.complete"
if [ ! -f "$marker" ]; then
  command -v npm >/dev/null || { echo "install-agents.sh: npm is missing: apt-get install -y nodejs npm" >&2; exit 1; }
  echo "installing @openai/codex@$CODEX_VERSION and @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $prefix" >&2
  rm -rf "$prefix"
  mkdir -p "$prefix"
  # npm's cache and the agents' own state stay in a temp dir: nothing lands in the caller's HOME.
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  npm install --global --prefix "$prefix" --cache "$scratch/npm" --no-audit --no-fund --loglevel=error \
    "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >&2
  mkdir "$scratch/.codex"
  HOME="$scratch" CODEX_HOME="$scratch/.codex" "$prefix/bin/codex" --version >&2
  HOME="$scratch" "$prefix/bin/claude" --version >&2
  touch "$marker"
fi
echo "$prefix/bin"
