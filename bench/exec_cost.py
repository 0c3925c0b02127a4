"""What a LocalProvider exec and a sandbox's whole life cost, before and after the command starter, side by side.

Run: python bench/exec_cost.py [ROUNDS] [--baseline REV]

Two worker processes, one per code base: "before" imports ``sandbox_middleware`` as it was at REV
(by default the commit before the command starter was wired into the provider, found in git
history; extracted with ``git archive``), "after" this checkout. One coordinator sends each worker
one operation at a time, sleeping 300 ms before each (commands in RL are separated by model turns,
and what costs most is what an idle machine pays again: the kernel's cgroup lock, cold caches),
every round interleaving all of them so machine noise hits all alike:

- ``exec``: ``true`` in a held ``isolation="bwrap"`` sandbox (RL's path: a command after idle; in a
  checkout with the plain-command path, the command init starts ``/usr/bin/true`` as bash would);
- ``exec-bash``: ``true;`` there, which bash runs (the ``;`` keeps it off the plain-command path): what
  ``exec`` costs through bash;
- ``raw``: ``true`` as a raw subprocess started the same way, in the same worker process
  (``anyio.open_process``, stdin ``/dev/null``, stdout and stderr pipes, a session of its own);
- ``blocking``: a blocking ``subprocess.run(["true"])`` in the same worker process, the reference
  of issue 31's bound (an async process start is itself slower than this);
- ``cycle``: create + exec of ``true`` + close of a sandbox (after: the create takes the spare made
  ahead; ``cycle-cold``, after only: the same on a provider with ``prestart=False``, a create that
  finds no spare);
- ``none``: ``true`` in a held ``isolation="none"`` sandbox;
- ``pre-containment``: the bwrap command line of the provider before the containment work (the host's
  root read-only, every capability kept, output to files), the reference of issue 23's bound.

It prints the median of each and the ratios the issues ask for: exec after idle / raw ``true``
and exec after idle / blocking ``subprocess.run`` (goal <= 3 each), cycle before / after (goal >= 2),
and hardened / pre-containment exec.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
_IDLE_S = 0.3
_MEMORY_MIB = 512
_WIRED = "from ._supervisor import"  # the line that wired the command starter into the provider
_PROVIDER = "sandbox_middleware/providers/local/_provider.py"


# --- a worker: one code base, one operation per line ------------------------------------------------


async def _serve(base: Path) -> None:
    import anyio

    from sandbox_middleware import LocalProvider, SandboxSpec

    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    hardened = LocalProvider(isolation="bwrap", base_dir=base / "bwrap")
    plain = LocalProvider(isolation="none", base_dir=base / "none")
    try:  # a checkout that has spare sandboxes: one without, to show what a create costs that finds none
        cold: Any = LocalProvider(isolation="bwrap", base_dir=base / "cold", prestart=False)
    except TypeError:
        cold = hardened
    spec = SandboxSpec(resources={"memory_mib": _MEMORY_MIB})  # two workers' sandboxes fit any budget
    try:
        held, held_plain = await hardened.create(spec), await plain.create(spec)
        old_box, control = base / "old" / "box", base / "old" / "control"
        old_box.mkdir(parents=True)
        control.mkdir()

        async def cycle(provider: Any = hardened) -> None:
            handle = await provider.create(spec)
            await provider.exec(handle, "true")
            await provider.close(handle)

        async def raw() -> None:
            process = await anyio.open_process(
                ["true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
            async with process:
                await process.wait()

        async def blocking() -> None:
            subprocess.run(["true"], check=True)  # noqa: ASYNC221 - the blocking reference, on purpose

        operations = {
            "exec": lambda: hardened.exec(held, "true"),
            "exec-bash": lambda: hardened.exec(held, "true;"),
            "none": lambda: plain.exec(held_plain, "true"),
            "cycle": cycle,
            "cycle-cold": lambda: cycle(cold),
            "raw": raw,
            "blocking": blocking,
            "pre-containment": lambda: _pre_containment(bwrap, old_box, control),
        }
        for operation in operations.values():  # warm-up
            await operation()
        print("ready", flush=True)
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            name = line.strip()
            started = time.perf_counter()
            await operations[name]()
            print(time.perf_counter() - started, flush=True)
    finally:
        await hardened.aclose()
        await plain.aclose()
        await cold.aclose()


async def _pre_containment(bwrap: str, root: Path, control: Path) -> None:
    """The pre-containment exec of ``true``: files for output, the host's environment, all capabilities."""
    import anyio

    argv = [
        bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--bind", str(root), str(root), "--unshare-net", "--unshare-pid", "--unshare-ipc",
        "--die-with-parent", "--chdir", str(root), "bash", "-c", "true",
    ]  # fmt: skip
    out_path, err_path = control / "out", control / "err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        process = await anyio.open_process(argv, stdin=None, stdout=out, stderr=err, cwd=root, env=dict(os.environ))
    await process.wait()
    out_path.read_bytes()
    err_path.read_bytes()
    out_path.unlink()
    err_path.unlink()


# --- the coordinator ------------------------------------------------------------------------------------


def _baseline() -> str:
    """The commit before the command starter was wired into the provider (``git log -S``)."""
    found = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", f"-S{_WIRED}", "--", _PROVIDER],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not found:
        sys.exit(f"bench/exec_cost.py: no commit wires the starter into {_PROVIDER}; pass --baseline REV")
    return f"{found[0]}^"


class _Worker:
    def __init__(self, label: str, tree: Path | None, where: Path) -> None:
        env = {**os.environ}
        if tree is not None:
            env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
        where.mkdir(mode=0o711)
        self.label = label
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(where)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd="/",
        )  # fmt: skip
        assert self._process.stdout is not None and self._process.stdin is not None
        self._in, self._out = self._process.stdin, self._process.stdout
        if self._out.readline().strip() != "ready":
            sys.exit(f"bench/exec_cost.py: the {label} worker did not start")

    def run(self, operation: str) -> float:
        self._in.write(operation + "\n")
        self._in.flush()
        return float(self._out.readline())

    def close(self) -> None:
        self._in.close()
        self._process.wait(timeout=60)


def main(rounds: int, baseline: str) -> None:
    if shutil.which("bwrap") is None:
        sys.exit("bench/exec_cost.py needs bwrap (apt-get install -y bubblewrap)")
    with tempfile.TemporaryDirectory(prefix="sandbox-middleware-bench-") as where:
        base = Path(where)
        os.chmod(where, 0o711)  # the sandboxes' own uids must reach their directories
        tree = base / "before-tree"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", baseline, "sandbox_middleware"], cwd=_ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        before, after = _Worker("before", tree, base / "before"), _Worker("after", None, base / "after")
        plan: list[tuple[_Worker, str]] = [
            (before, "exec"), (after, "exec"), (after, "exec-bash"), (after, "raw"), (after, "blocking"),
            (before, "cycle"), (after, "cycle"), (after, "cycle-cold"), (after, "none"), (after, "pre-containment"),
        ]  # fmt: skip
        timings: dict[tuple[str, str], list[float]] = {(w.label, op): [] for w, op in plan}
        try:
            for _ in range(rounds):
                for worker, operation in plan:
                    time.sleep(_IDLE_S)
                    timings[(worker.label, operation)].append(worker.run(operation))
        finally:
            before.close()
            after.close()
    medians: dict[tuple[str, str], float] = {key: statistics.median(values) * 1000 for key, values in timings.items()}
    print(f"LocalProvider, median of {rounds} interleaved rounds, each after {_IDLE_S * 1000:.0f} ms idle")
    print(f"before: {baseline} ({_describe(baseline)}); after: this checkout")
    rows = [
        ("raw subprocess of `true` (after's process)", ("after", "raw")),
        ("blocking subprocess.run(['true']) (same)", ("after", "blocking")),
        ("exec `true`, bwrap, before", ("before", "exec")),
        ("exec `true`, bwrap, after", ("after", "exec")),
        ("exec `true;` (bash runs it), bwrap, after", ("after", "exec-bash")),
        ("exec `true`, isolation='none', after", ("after", "none")),
        ("pre-containment bwrap command line", ("after", "pre-containment")),
        ("create + exec + close, bwrap, before", ("before", "cycle")),
        ("create + exec + close, bwrap, after", ("after", "cycle")),
        ("same, after, no spare (prestart=False)", ("after", "cycle-cold")),
    ]
    for label, key in rows:
        print(f"  {label:<44} {medians[key]:8.2f} ms")
    raw = medians[("after", "raw")]
    print("ratios:")
    print(
        f"  exec after idle / raw `true`:  before {medians[('before', 'exec')] / raw:5.2f}x   after "
        f"{medians[('after', 'exec')] / raw:5.2f}x   (goal: after <= 3x)"
    )
    blocking = medians[("after", "blocking")]
    print(
        f"  exec after idle / subprocess.run(['true']):  before {medians[('before', 'exec')] / blocking:5.2f}x   "
        f"after {medians[('after', 'exec')] / blocking:5.2f}x   (issue 31's goal: after <= 3x)"
    )
    print(f"  same, after, through bash (`true;`): {medians[('after', 'exec-bash')] / blocking:5.2f}x")
    print(
        f"  cycle before / after:          {medians[('before', 'cycle')] / medians[('after', 'cycle')]:5.2f}x"
        "   (goal: >= 2x)"
    )
    print(f"  cycle before / after, no spare: {medians[('before', 'cycle')] / medians[('after', 'cycle-cold')]:5.2f}x")
    print(
        f"  exec after / pre-containment:  {medians[('after', 'exec')] / medians[('after', 'pre-containment')]:5.2f}x"
        "   (issue 23: within 2x)"
    )


def _describe(revision: str) -> str:
    return subprocess.run(
        ["git", "log", "-1", "--format=%h %s", revision], cwd=_ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()[:90]


def _arguments(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("rounds", nargs="?", type=int, default=40)
    parser.add_argument("--baseline", help="the revision measured as 'before' (default: before the starter)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = _arguments(sys.argv[1:])
    if options.worker:
        import anyio

        anyio.run(_serve, Path(options.worker))
    else:
        main(options.rounds, options.baseline or _baseline())
