"""Odd arguments: NUL bytes, lone surrogates, wrong types, bad numbers, reserved workdirs: each a typed error."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox_middleware import LocalProvider, SandboxArgumentError, SandboxLimitError, SandboxSpec, SandboxValueError
from tests.leftovers import sandbox_dirs

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda p, h, tmp: p.exec(h, "echo a\0b"), "command"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A": "x\0y"}), "env"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A\0": "x"}), "env name"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A=B": "x"}), "env name"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A": 5}), "env"),
        (lambda p, h, tmp: p.exec(h, "true", timeout_s=math.nan), "timeout_s"),
        (lambda p, h, tmp: p.exec(h, "true", timeout_s=-1), "timeout_s"),
        (lambda p, h, tmp: p.exec(h, "true", timeout_s="5"), "timeout_s"),
        (lambda p, h, tmp: p.exec(h, "true", cwd="a\0b"), "cwd"),
        (lambda p, h, tmp: p.upload_file(h, tmp / "src.txt", "x\0y"), "target_path"),
        (lambda p, h, tmp: p.upload_file(h, tmp / "src.txt", "n" * 300), "target_path"),
        (lambda p, h, tmp: p.download_file(h, "a\0b", tmp / "out"), "source_path"),
        (lambda p, h, tmp: p.download_file(h, "f", Path(str(tmp) + "/o\0ut")), "target_path"),
    ],
)
async def test_bad_arguments_are_typed_errors(
    provider: LocalProvider, tmp_path: Path, call: object, argument: str
) -> None:
    """Each unusable argument raises SandboxArgumentError naming it, never a raw ValueError or OSError."""
    (tmp_path / "src.txt").write_text("x")
    handle = await provider.create(SandboxSpec())
    with pytest.raises(SandboxArgumentError, match=argument):
        await call(provider, handle, tmp_path)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda p, h: p.exec(h, "true", timeout_s="1"), "timeout_s"),
        (lambda p, h: p.exec(h, "echo \ud800"), "command"),
        (lambda p, h: p.exec(h, "true", env={"A": "\ud800"}), "env"),
        (lambda p, h: p.exec(h, "true", cwd="\ud800"), "cwd"),
        (lambda p, h: p.upload_file(h, 3, "a"), "source_path"),
        (lambda p, h: p.download_file(h, "a", 3), "target_path"),
        (lambda p, h: p.upload_file(h, Path("/etc/hostname"), "\ud800"), "target_path"),
    ],
)
async def test_more_bad_arguments_are_typed(provider: LocalProvider, call: Any, argument: str) -> None:
    handle = await provider.create(SandboxSpec())
    with pytest.raises(SandboxArgumentError, match=argument):
        await call(provider, handle)


async def test_huge_timeout_means_none(provider: LocalProvider) -> None:
    handle = await provider.create(SandboxSpec())
    assert (await provider.exec(handle, "echo ok", timeout_s=10**400)).stdout == "ok\n"


@pytest.mark.parametrize(
    ("spec", "argument"),
    [
        (lambda: SandboxSpec(env={"A": "x\0"}), "spec.env"),
        (lambda: SandboxSpec(ttl_s=math.nan), "spec.ttl_s"),
        (lambda: SandboxSpec(ttl_s=-1), "spec.ttl_s"),
        (lambda: SandboxSpec(ttl_s=1e10), "spec.ttl_s"),
        (lambda: SandboxSpec(workdir="w\0"), "spec.workdir"),
        (lambda: SandboxSpec(workdir="w" * 300), "spec.workdir"),
        (lambda: SandboxSpec(workdir="/"), "spec.workdir"),
        (lambda: SandboxSpec(workdir="/proc/x"), "spec.workdir"),
        (lambda: SandboxSpec(entrypoint=["server"]), "entrypoint"),
        (lambda: SandboxSpec(resources={"memory_mib": -64}), "resources.memory_mib"),
        (lambda: SandboxSpec(resources={"memory_mib": 10**30}), "resources.memory_mib"),
        (lambda: SandboxSpec(resources={"disk_gib": math.inf}), "disk_gib"),
        (lambda: SandboxSpec(resources={"cpu": "two"}), "cpu"),
    ],
)
async def test_bad_specs_are_typed_errors_and_leave_nothing(
    provider: LocalProvider, spec: Callable[[], SandboxSpec], argument: str, sandbox_base: Path
) -> None:
    """A bad spec is refused (by the spec itself, or at create) before anything is made: no directory, no cgroup."""
    with pytest.raises(SandboxValueError, match=argument):
        await provider.create(spec())
    assert sandbox_dirs(sandbox_base) == []


@pytest.mark.parametrize("workdir", ["//etc", "//proc", "/usr/.", "/workspace/../etc"])
async def test_reserved_workdirs_after_normalising(provider: LocalProvider, workdir: str) -> None:
    with pytest.raises(SandboxArgumentError, match="system directory"):
        await provider.create(SandboxSpec(workdir=workdir))


async def test_more_odd_inputs(provider: LocalProvider) -> None:
    """A missing handle, metadata that is no mapping, and a GPU request are typed errors."""
    with pytest.raises(SandboxArgumentError, match="handle"):
        await provider.exec(None, "true")  # type: ignore[arg-type]
    with pytest.raises(SandboxArgumentError, match="metadata"):
        await provider.create(SandboxSpec(metadata=["x"]))  # type: ignore[arg-type]
    with pytest.raises(SandboxLimitError, match="GPU"):
        await provider.create(SandboxSpec(resources={"gpu": 1}))


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"memory_mib": 10**400}, "memory_mib"),
        ({"pids": 0.5}, "pids"),
        ({"base_dir": "/tmp/a\0b"}, "base_dir"),
        ({"ro_paths": ["relative/path"]}, "ro_paths"),
        ({"ro_paths": ["/does/not/exist"]}, "ro_paths"),
        ({"sandbox_uid": 0}, "sandbox_uid"),
    ],
)
def test_bad_provider_options_are_typed(options: dict[str, Any], argument: str) -> None:
    with pytest.raises(SandboxArgumentError, match=argument):
        LocalProvider(**options)
