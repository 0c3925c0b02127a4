"""The price of containment: one ``exec`` of ``true`` before and after the hardening, side by side.

Run: python bench/exec_cost.py [ROUNDS]

"before" is the provider's exec path as it was until the containment work, reproduced here: a
bwrap command line with the host's root bound read-only and every capability kept, output to
files. "after" is today's ``LocalProvider(isolation="bwrap")``: no capabilities, a minimal host
view built per command, a clean environment, the sandbox's cgroups joined through ``sh``, output
through bounded pipes. ``isolation="none"`` is printed beside them. Rounds alternate between the
three so machine noise hits all alike; it prints the median per exec and the ratios.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from sandbox_middleware import LocalProvider, SandboxSpec


async def _before(bwrap: str, root: Path, control: Path) -> None:
    """The pre-hardening exec of ``true``: files for output, the host's environment, all capabilities."""
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


async def main(rounds: int) -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        sys.exit("bench/exec_cost.py needs bwrap (apt-get install -y bubblewrap)")
    with tempfile.TemporaryDirectory(prefix="sandbox-middleware-bench-") as where:
        base = Path(where)
        os.chmod(where, 0o711)  # the sandboxes' own uids must reach their directories
        (base / "old" / "box").mkdir(parents=True)
        (base / "old" / "control").mkdir()
        hardened = LocalProvider(isolation="bwrap", base_dir=base / "new")
        plain = LocalProvider(isolation="none", base_dir=base / "none")
        boxes = [await hardened.create(SandboxSpec()), await plain.create(SandboxSpec())]
        timings: dict[str, list[float]] = {"before (bwrap, as it was)": [], "after (bwrap, hardened)": [], "none": []}
        calls = {
            "before (bwrap, as it was)": lambda: _before(bwrap, base / "old" / "box", base / "old" / "control"),
            "after (bwrap, hardened)": lambda: hardened.exec(boxes[0], "true"),
            "none": lambda: plain.exec(boxes[1], "true"),
        }
        for _ in range(3):  # warm-up
            for call in calls.values():
                await call()
        for _ in range(rounds):
            for name, call in calls.items():
                started = time.perf_counter()
                await call()
                timings[name].append(time.perf_counter() - started)
        await hardened.aclose()
        await plain.aclose()
    medians = {name: statistics.median(values) * 1000 for name, values in timings.items()}
    before = medians["before (bwrap, as it was)"]
    print(f"exec of `true`, median of {rounds} rounds (interleaved):")
    for name, value in medians.items():
        print(f"  {name:<28} {value:7.2f} ms   {value / before:5.2f}x before")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 200)
