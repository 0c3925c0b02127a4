"""What a run leaves behind in a temp directory: sandbox and workload directories."""

from __future__ import annotations

from pathlib import Path

LEFT_BEHIND = ("local-", "sandbox-middleware-")


def left_behind(directory: Path) -> list[str]:
    """Leftovers in ``directory`` and in LocalProvider's default base_dir there (``llm-sandbox-middleware-UID``)."""
    found = [entry.name for entry in directory.iterdir() if entry.name.startswith(LEFT_BEHIND)]
    for base in directory.glob("llm-sandbox-middleware-*"):
        found += [f"{base.name}/{entry.name}" for entry in base.iterdir() if entry.name.startswith(LEFT_BEHIND)]
    return sorted(found)
