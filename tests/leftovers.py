"""What a run leaves behind in a temp directory: sandbox and workload directories."""

from __future__ import annotations

from pathlib import Path

from sandbox_middleware.providers.local._records import RECORD, SPARE_RECORD

LEFT_BEHIND = ("local-", "sandbox-middleware-")


def left_behind(directory: Path) -> list[str]:
    """Leftovers in ``directory`` and in LocalProvider's default base_dir there (``llm-sandbox-middleware-UID``),
    and mounts anywhere below it (a sandbox's tmpfs)."""
    found = [entry.name for entry in directory.iterdir() if entry.name.startswith(LEFT_BEHIND)]
    for base in directory.glob("llm-sandbox-middleware-*"):
        found += [f"{base.name}/{entry.name}" for entry in base.iterdir() if entry.name.startswith(LEFT_BEHIND)]
    return sorted(found) + [f"mount {mount}" for mount in mounts_below(directory)]


def sandbox_cgroups() -> set[str]:
    """Every LocalProvider sandbox cgroup on this machine (``.../sandbox-middleware/local-*``, any
    controller), as paths: taken at a run's start and end, what is new at the end was left by it."""
    root = Path("/sys/fs/cgroup")
    found = set()
    for parent in (
        *root.glob("sandbox-middleware"),
        *root.glob("*/sandbox-middleware"),
        *root.glob("*/**/sandbox-middleware"),
    ):
        found.update(str(group) for group in parent.glob("local-*") if group.is_dir())
    return found


def mounts_below(directory: Path) -> list[str]:
    """The mount points below ``directory`` (from /proc/self/mounts; octal escapes as the kernel writes them)."""
    prefix = str(directory).rstrip("/") + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1].encode().decode("unicode_escape") for line in mounts]
    return [point for point in points if point.startswith(prefix)]


def spare_dirs(base: Path) -> list[Path]:
    """The spares in a LocalProvider's ``base``: directories with a spare record and no sandbox record
    (made ahead by a live provider, never handed out)."""
    if not base.exists():
        return []
    return [path for path in base.iterdir() if (path / SPARE_RECORD).exists() and not (path / RECORD).exists()]


def sandbox_dirs(base: Path) -> list[Path]:
    """The sandbox directories in a LocalProvider's ``base``, not counting live providers' spares."""
    if not base.exists():
        return []
    spares = spare_dirs(base)
    return [path for path in base.iterdir() if path not in spares]
