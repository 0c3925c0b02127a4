"""Every error class of ``sandbox_middleware``, in one place.

The hierarchy (``RuntimeError`` at the root; ``[NeMo Gym]`` marks a class that also derives from
NeMo Gym 0.7.0's class of the same name when NeMo Gym is installed, so NeMo Gym's own ``except``
clauses catch ours)::

    RuntimeError
    └── SandboxError                          every error this package raises about a sandbox
        ├── SandboxValueError                 (also ValueError, TypeError) a value NeMo Gym would refuse
        │   └── SandboxArgumentError          an unusable argument; the message names it
        ├── SandboxCreateError [NeMo Gym]     the provider could not create a sandbox (retried by default)
        │   ├── SandboxCreateVerificationError [NeMo Gym]   a new sandbox failed its readiness checks
        │   ├── SandboxRateLimitedError       the provider said "too many" (HTTP 429); retried after Retry-After
        │   └── testing.InjectedCreateError   (also InjectedFault) an injected create failure
        ├── SandboxPtyError [NeMo Gym]        a PTY session failed outside a normal exit
        ├── SandboxNotFoundError              no live sandbox of this provider has that handle
        │   └── SandboxExpiredError           its ttl_s ran out
        ├── SandboxSnapshotError              a snapshot cannot be taken, used or deleted as asked (never retried)
        │   └── SandboxSnapshotNotFoundError  (also SandboxNotFoundError) no snapshot of this provider has that id
        ├── SandboxPathError                  a path would leave the sandbox
        ├── SandboxLimitError                 a limit this machine cannot enforce (never retried)
        ├── SandboxQuotaExceededError         a hard provider quota is exhausted (never retried); names the quota
        ├── SandboxAdmissionError             the shared limiter failed, or a create group can never fit max_held
        ├── SandboxTransferLimitError         a file larger than max_transfer_bytes
        ├── BwrapUnavailableError             isolation="bwrap" cannot run on this machine
        ├── DockerUnavailableError            no Docker daemon answers at the socket (or not an API version we speak)
        │   └── DockerRuntimeNotFoundError    the daemon has no OCI runtime of the name asked for (runtime="runsc")
        ├── SandboxImageNotFoundError         spec.image is not on the daemon (never retried)
        ├── SandboxNotStartedError            a Sandbox facade used before start()
        ├── RegistryError                     an unknown or duplicate provider or middleware name
        ├── ConfigError                       a config that cannot be built; lists every problem
        ├── testing.InjectedFault             a failure the fault injector made on purpose
        └── (CLI) CommandFailedError          a workload command exited non-zero
    Exception
    └── (CLI) UsageError                      a command-line argument the program cannot use

Python's ``except`` matches by inheritance only, so the reverse direction (our ``except`` catching
NeMo Gym's create failures) needs translation: ``as_create_error`` turns a NeMo Gym create failure
into ours (so an instance of both libraries' ``SandboxCreateError``), chained to the original; and
``SANDBOX_CREATE_ERRORS`` names both libraries' classes in one tuple for code that sees the original.

Each public class names its public module (``__module__``), so ``error.type`` on dashboards reads
e.g. ``sandbox_middleware.SandboxCreateError``; config's ``on:`` names are looked up here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

from ._nemo import NEMO_GYM, NemoCreateError, NemoCreateVerificationError, NemoPtyError

__all__ = [
    "PUBLIC",
    "SANDBOX_CREATE_ERRORS",
    "BwrapUnavailableError",
    "CommandFailedError",
    "ConfigError",
    "DockerRuntimeNotFoundError",
    "DockerUnavailableError",
    "InjectedCreateError",
    "InjectedFault",
    "RegistryError",
    "SandboxAdmissionError",
    "SandboxArgumentError",
    "SandboxCreateError",
    "SandboxCreateVerificationError",
    "SandboxError",
    "SandboxExpiredError",
    "SandboxImageNotFoundError",
    "SandboxLimitError",
    "SandboxNotFoundError",
    "SandboxNotStartedError",
    "SandboxPathError",
    "SandboxPtyError",
    "SandboxQuotaExceededError",
    "SandboxRateLimitedError",
    "SandboxSnapshotError",
    "SandboxSnapshotNotFoundError",
    "SandboxTransferLimitError",
    "SandboxValueError",
    "UsageError",
    "as_create_error",
]


class SandboxError(RuntimeError):
    """Base class of every error this package raises about a sandbox."""


class SandboxValueError(SandboxError, ValueError, TypeError):
    """A value type got a field NeMo Gym would refuse (a port, an endpoint URL, a resource key).

    Also a ``ValueError`` and a ``TypeError``, the classes NeMo Gym raises for the same inputs.
    """


class SandboxArgumentError(SandboxValueError):
    """An argument is unusable (a NUL byte, a NaN or negative number, a non-string, an over-long name).

    The message names the argument; like every ``SandboxValueError`` it is also a ``ValueError``.
    """


class SandboxCreateError(SandboxError, NemoCreateError):
    """The provider could not create a sandbox (NeMo Gym's ``SandboxCreateError`` too)."""


class SandboxCreateVerificationError(SandboxCreateError, NemoCreateVerificationError):
    """A newly created sandbox failed the provider's readiness checks."""


class _KeywordFields:
    """Pickled as ``type(error)(message, **fields)``: ``BaseException`` pickles ``args`` only, from which
    a class whose fields are keyword-only cannot be made again (``_keywords`` names those fields)."""

    _keywords: ClassVar[tuple[str, ...]]

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuilt, (type(self), str(self), {name: getattr(self, name) for name in self._keywords}))


def _rebuilt(cls: Callable[..., BaseException], message: str, fields: dict[str, object]) -> BaseException:
    return cls(message, **fields)


class SandboxRateLimitedError(_KeywordFields, SandboxCreateError):
    """The provider refused a create as rate-limited (HTTP 429 or its SDK's rate-limit error).

    A ``SandboxCreateError``, so a retry layer above retries it; the admission layer that raised it
    holds every create back for ``retry_after_s`` (the provider's ``Retry-After``, or its default)
    first. ``provider`` names the provider; the provider's own error is ``__cause__``.
    """

    _keywords = ("provider", "retry_after_s")

    def __init__(self, message: str, *, provider: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.provider = provider
        self.retry_after_s = retry_after_s


class SandboxQuotaExceededError(_KeywordFields, SandboxError):
    """A hard quota of the provider account is exhausted (disk, CPU, sandboxes): asking again cannot
    succeed until something is freed or the quota raised, so it is never retried.

    ``quota`` names the quota (``"disk"``, ``"cpu"``, ...; ``"unknown"`` when the provider's message
    does not say), ``provider`` the provider; the provider's own error is ``__cause__``.
    """

    _keywords = ("provider", "quota")

    def __init__(self, message: str, *, provider: str, quota: str) -> None:
        super().__init__(message)
        self.provider = provider
        self.quota = quota


class SandboxAdmissionError(SandboxError):
    """The admission layer could not consult its shared limiter (the host's SQLite file, the Ray
    actor), or a group of creates made together (``Sandbox.fork``) needs more held slots at once than
    ``max_held``: the create was not attempted. The message names the limiter and what failed."""


class SandboxPtyError(SandboxError, NemoPtyError):
    """A PTY session failed outside a normal process exit."""


class SandboxNotFoundError(SandboxError):
    """The handle names no live sandbox of this provider (never created here, or already closed)."""


class SandboxExpiredError(SandboxNotFoundError):
    """The sandbox's ``ttl_s`` ran out: its processes were killed and it accepts no more commands."""


class SandboxSnapshotError(SandboxError):
    """A snapshot cannot be taken, used or deleted as asked (a provider without the capability, a
    descriptor that does not match the provider's own record of it).

    Not a ``SandboxCreateError``: asking again cannot succeed, so retry layers do not retry it.
    """


class SandboxSnapshotNotFoundError(SandboxSnapshotError, SandboxNotFoundError):
    """The snapshot names none this provider holds: never taken here, taken by another provider, or deleted."""


class SandboxPathError(SandboxError):
    """A file path would leave the sandbox (``..`` or a symlink pointing outside)."""


class SandboxLimitError(SandboxError):
    """A resource limit was asked for that this machine cannot enforce (it is refused, never ignored).

    Not a ``SandboxCreateError``: asking again cannot succeed, so retry layers do not retry it.
    """


class SandboxTransferLimitError(SandboxError):
    """A file transfer was refused because the file is larger than the provider's ``max_transfer_bytes``."""


class BwrapUnavailableError(SandboxError):
    """``isolation="bwrap"`` cannot run here: no ``bwrap`` (or ``setpriv`` as root), or it fails to start."""


class DockerUnavailableError(SandboxError):
    """No Docker Engine API answers at the provider's socket, or it speaks no API version the provider does.

    Raised at construction (the daemon is asked once, to negotiate the API version) and by any
    operation but ``create`` while the daemon is down; a ``create`` that cannot reach the daemon
    raises ``SandboxCreateError`` instead, so retry layers retry it.
    """


class DockerRuntimeNotFoundError(DockerUnavailableError):
    """The daemon has no OCI runtime of the name ``DockerProvider(runtime=...)`` asked for.

    Raised at construction, from the daemon's ``/info`` ``Runtimes``; the message names the runtime,
    those the daemon has, and how to register one (``daemon.json``'s ``runtimes``).
    """


class SandboxImageNotFoundError(SandboxError):
    """``spec.image`` is not on the daemon (and pulling is off, or the pull found nothing).

    Not a ``SandboxCreateError``: asking again cannot succeed, so retry layers do not retry it.
    """


class SandboxNotStartedError(SandboxError):
    """An operation needs a started sandbox; call ``start()`` or use ``async with``."""


class RegistryError(SandboxError):
    """An unknown or duplicate provider or middleware name."""


class ConfigError(SandboxError):
    """A configuration that cannot be built; the message names the entry, the key and what is allowed.

    ``problems`` lists every problem found, one line each (the message is those lines).
    """

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class InjectedFault(SandboxError):
    """A failure the fault injector (``sandbox_middleware.testing``) made on purpose."""


class InjectedCreateError(InjectedFault, SandboxCreateError):
    """An injected create failure (a ``SandboxCreateError``, so retry layers treat it as one)."""


class CommandFailedError(SandboxError):
    """A workload command of the CLI's ``run`` exited non-zero."""


class UsageError(Exception):
    """A command-line argument the program cannot work with; the message names the argument."""


def as_create_error(error: BaseException) -> BaseException:
    """A create failure of either library as an instance of both libraries' ``SandboxCreateError``.

    Ours already is (it derives from NeMo Gym's); NeMo Gym's becomes ours of the same kind
    (``SandboxCreateVerificationError`` for its verification error), with its message, chained to it
    (``__cause__``), so ``except`` clauses written against either library catch it. Anything else is
    returned as it is.
    """
    if isinstance(error, SandboxCreateError) or NEMO_GYM is None or not isinstance(error, NemoCreateError):
        return error
    kind = SandboxCreateVerificationError if isinstance(error, NemoCreateVerificationError) else SandboxCreateError
    translated = kind(f"{error} ({type(error).__module__}.{type(error).__qualname__})")
    translated.__cause__ = error
    return translated


SANDBOX_CREATE_ERRORS: tuple[type[Exception], ...] = cast(
    "tuple[type[Exception], ...]", tuple(c for c in SandboxCreateError.__mro__ if c.__name__ == "SandboxCreateError")
)
"""Create failures of this package and of NeMo Gym: ``except SANDBOX_CREATE_ERRORS:`` catches both."""

PUBLIC: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        SandboxError,
        SandboxValueError,
        SandboxArgumentError,
        SandboxCreateError,
        SandboxCreateVerificationError,
        SandboxRateLimitedError,
        SandboxQuotaExceededError,
        SandboxAdmissionError,
        SandboxPtyError,
        SandboxNotFoundError,
        SandboxExpiredError,
        SandboxSnapshotError,
        SandboxSnapshotNotFoundError,
        SandboxPathError,
        SandboxLimitError,
        SandboxTransferLimitError,
        BwrapUnavailableError,
        DockerUnavailableError,
        DockerRuntimeNotFoundError,
        SandboxImageNotFoundError,
        SandboxNotStartedError,
        RegistryError,
        ConfigError,
    )
}
"""The errors ``sandbox_middleware`` exports, by name (config's ``on:`` looks names up here)."""

for _error in PUBLIC.values():
    _error.__module__ = "sandbox_middleware"
for _error in (InjectedFault, InjectedCreateError):
    _error.__module__ = "sandbox_middleware.testing"
CommandFailedError.__module__ = UsageError.__module__ = "sandbox_middleware.cli"
del _error
