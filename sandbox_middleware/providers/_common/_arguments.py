"""The providers' checks of what callers pass: text, numbers, sandbox paths, environments, workdirs.

Each check returns the value it accepts or raises a ``SandboxArgumentError`` (``SandboxPathError``
for a path that would leave the sandbox) naming the argument, never a raw ``ValueError`` or
``OSError`` from further down.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

from ..._errors import SandboxArgumentError, SandboxPathError

__all__ = [
    "DEFAULT_VIEW_ROOT",
    "SYSTEM_DIRS",
    "as_float",
    "check_text",
    "checked_env",
    "checked_exec",
    "checked_ro_path",
    "checked_snapshot",
    "checked_texts",
    "checked_timeout",
    "checked_view_root",
    "fspath",
    "positive_number",
    "sandbox_id_of",
    "sandbox_parts",
]

DEFAULT_VIEW_ROOT = "/workspace"
# The host's system directories: what commands need (LocalProvider shows them read-only under bwrap).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Absolute workdirs that would hide what commands need, or show the host's own.
_RESERVED_VIEWS = ("/", "/proc", "/dev", "/sys", "/etc", "/tmp", *SYSTEM_DIRS)
_MAX_ENV_NAME = 1024
_NAME_MAX = 255
_PATH_MAX = 4095


def check_text(value: object, what: str) -> str:
    """``value`` as a string fit for a command line, path or environment, or ``SandboxArgumentError``."""
    if not isinstance(value, str):
        raise SandboxArgumentError(f"{what} must be a string, not {type(value).__name__} ({value!r:.80})")
    if "\0" in value:
        raise SandboxArgumentError(f"{what} contains a NUL byte, which no command, path or variable can hold")
    try:
        os.fsencode(value)
    except UnicodeEncodeError as exc:
        raise SandboxArgumentError(f"{what} cannot be encoded for the OS (a lone surrogate?): {exc}") from exc
    return value


def checked_texts(value: object, what: str) -> dict[str, str]:
    """``value`` as a mapping of strings each fit for ``check_text`` (metadata), or ``SandboxArgumentError``."""
    if not isinstance(value, Mapping):
        raise SandboxArgumentError(f"{what} must be a mapping of strings, not {type(value).__name__}")
    return {check_text(key, f"{what} key"): check_text(text, f"{what}[{key!r}]") for key, text in value.items()}


def as_float(value: object, what: str) -> float:
    """An int or float as a float (an int too large for one is infinity); else ``SandboxArgumentError``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SandboxArgumentError(f"{what} must be a number, not {type(value).__name__} ({value!r:.80})")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def positive_number(value: object, what: str, *, allow_none: bool = True, maximum: float = 2.0**53) -> float | None:
    """``value`` if it is a finite number in (0, maximum] (or None where allowed), else ``SandboxArgumentError``."""
    if value is None and allow_none:
        return None
    number = as_float(value, what)
    if not math.isfinite(number) or not 0 < number <= maximum:
        raise SandboxArgumentError(f"{what} must be a finite number above 0 and at most {maximum:g}, not {value!r:.80}")
    return number


def sandbox_parts(path: str | bytes, roots: Sequence[PurePosixPath], what: str) -> tuple[str, ...]:
    """The components of sandbox path ``path`` below the sandbox root.

    A name that is not UTF-8 (a command may make one) is a ``str`` with surrogate escapes, as
    ``os.listdir`` returns it, or ``bytes``: either names the same file, byte for byte.

    Relative paths are taken against the root; absolute ones must lie under one of ``roots`` (the
    paths at which the root is seen). ``..`` is refused outright rather than resolved.
    """
    if isinstance(path, bytes):  # a name as the OS has it: kept byte for byte (surrogateescape)
        path = os.fsdecode(path)
    check_text(path, what)
    size = len(os.fsencode(path))
    if size > _PATH_MAX:
        raise SandboxArgumentError(f"{what} is {size} bytes long; paths are limited to {_PATH_MAX}")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        for root in roots:
            if pure == root or root in pure.parents:
                pure = pure.relative_to(root)
                break
        else:
            raise SandboxPathError(
                f"{what} {path!r} is outside the sandbox (its root is seen at {', '.join(map(str, roots))}); "
                "use a relative path or one under the sandbox root"
            )
    parts = tuple(part for part in pure.parts if part != ".")
    if ".." in parts:
        raise SandboxPathError(f"{what} {path!r} uses '..', which could lead outside the sandbox; name the file")
    for part in parts:
        if len(os.fsencode(part)) > _NAME_MAX:
            raise SandboxArgumentError(
                f"{what} {path!r} has a component of {len(os.fsencode(part))} bytes; names are limited to {_NAME_MAX}"
            )
    return parts


def checked_view_root(workdir: str) -> PurePosixPath:
    """An absolute workdir, normalised ('//etc/.' is '/etc'), refused where it would cover what
    commands need or show the host's own."""
    view = PurePosixPath("/" + posixpath.normpath(workdir).lstrip("/"))
    sandbox_parts(str(view), (view,), "spec.workdir")  # NUL, over-long names
    if any(view == PurePosixPath(r) or (r != "/" and PurePosixPath(r) in view.parents) for r in _RESERVED_VIEWS):
        raise SandboxArgumentError(
            f"spec.workdir {workdir!r} would cover a system directory commands need; use e.g. /workspace"
        )
    return view


def sandbox_id_of(handle: object) -> str:
    sandbox_id = getattr(handle, "sandbox_id", None)
    if not isinstance(sandbox_id, str):
        raise SandboxArgumentError(f"handle must be a SandboxHandle with a string sandbox_id, not {handle!r:.80}")
    return sandbox_id


def checked_ro_path(path: str) -> str:
    check_text(path, "ro_paths entry")
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SandboxArgumentError(f"ro_paths entry {path!r} must be an absolute path that exists")
    return path


def fspath(value: object, what: str) -> str:
    """A host path as ``str`` (bytes kept byte for byte, as surrogate escapes)."""
    if not isinstance(value, str | bytes | os.PathLike):
        raise SandboxArgumentError(f"{what} must be a path (str, bytes or os.PathLike), not {type(value).__name__}")
    path = os.fspath(value)
    return os.fsdecode(path) if isinstance(path, bytes) else path


def checked_timeout(timeout_s: object) -> float | None:
    """Seconds, or None for no timeout (also for infinity, or an int too large for a float)."""
    if timeout_s is None:
        return None
    value = as_float(timeout_s, "timeout_s")
    if math.isnan(value) or value < 0:
        raise SandboxArgumentError(f"timeout_s must be a number of seconds >= 0, not {timeout_s!r:.80}")
    return None if math.isinf(value) else value


def checked_env(env: Mapping[str, str], what: str) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise SandboxArgumentError(f"{what} must be a mapping of names to strings, not {type(env).__name__}")
    checked = {}
    for name, value in env.items():
        check_text(name, f"{what} name")
        if not name or "=" in name or len(name) > _MAX_ENV_NAME:
            raise SandboxArgumentError(f"{what} name {name!r:.80} is not a valid variable name")
        checked[name] = check_text(value, f"{what}[{name!r}]")
    return checked


def checked_exec(
    command: object, env: Mapping[str, str] | None, timeout_s: object
) -> tuple[dict[str, str], float | None]:
    """``exec``'s own arguments checked: the command's text, then its environment and its timeout (None: none)."""
    check_text(command, "command")
    return checked_env(env or {}, "env"), checked_timeout(timeout_s)


def checked_snapshot(paths: object, metadata: object) -> tuple[list[str] | None, dict[str, str]]:
    """``snapshot``'s own arguments checked: ``paths`` None (the working directory) or a non-empty list of
    texts, then ``metadata`` a mapping of texts (None: none)."""
    if paths is not None and (isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths):
        raise SandboxArgumentError(
            "snapshot paths must be a non-empty list of sandbox paths (or None for the work directory), "
            f"not {paths!r:.80}"
        )
    checked = None if paths is None else [check_text(path, "snapshot path") for path in paths]
    return checked, checked_texts(metadata if metadata is not None else {}, "snapshot metadata")
