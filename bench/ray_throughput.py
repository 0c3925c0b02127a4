"""Sessions per second of one workload: `sandbox-middleware run` in one process, and over Ray with 2 workers.

Starts its own Ray head on loopback (`ray start --head --node-ip-address 127.0.0.1 --num-cpus 2`) and
stops it after. Each figure is the wall time of the whole command (start-up, actors and table
included: what a user waits for), best of --repeat, measured side by side in one run. On a 2-core
machine Ray competes with the sandboxes for the same cores: the ratio is Ray's overhead here, not a
speed-up.

    python bench/ray_throughput.py --sessions 400 --concurrency 8
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "sandbox_middleware", "run"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
HEAD_OPTIONS = (
    "start --head --node-ip-address 127.0.0.1 --port {port} --num-cpus 2"
    " --include-dashboard=false --disable-usage-stats"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def timed(arguments: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([*CLI, *arguments], capture_output=True, text=True, env=ENV, timeout=1800)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(arguments)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--commands", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    workload = [
        "--sessions",
        str(args.sessions),
        "--concurrency",
        str(args.concurrency),
        "--commands",
        str(args.commands),
    ]
    ray = Path(sys.executable).parent / "ray"
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    address = f"127.0.0.1:{free_port()}"
    try:
        subprocess.run(
            [str(ray), *shlex.split(HEAD_OPTIONS.format(port=address.rsplit(":", 1)[1])), "--temp-dir", temp],
            check=True,
            capture_output=True,
            env=ENV,
            timeout=120,
        )
        local, over_ray = [], []
        for _ in range(args.repeat):  # interleaved, so both see the same machine load
            local.append(timed(workload))
            over_ray.append(timed([*workload, "--ray", address, "--workers", "2"]))
    finally:
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    one, two = args.sessions / min(local), args.sessions / min(over_ray)
    print(
        f"{args.sessions} sessions, concurrency {args.concurrency} in total, {args.commands} commands each; "
        f"best of {args.repeat}, wall time of the whole command"
    )
    print(f"  one process            {one:8.1f} sessions/s  ({min(local):.2f} s)")
    print(f"  Ray, 2 workers         {two:8.1f} sessions/s  ({min(over_ray):.2f} s)")
    print(f"  Ray / one process      {two / one:8.2f}x")


if __name__ == "__main__":
    main()
