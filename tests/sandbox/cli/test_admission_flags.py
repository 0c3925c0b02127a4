"""`run --warm N` and `--max-create-rate R`: the layers are added where the recommended stack puts them."""

from __future__ import annotations

from pathlib import Path

from sandbox_middleware import AdmissionMiddleware, WarmPoolMiddleware
from sandbox_middleware._config import resolve_config
from sandbox_middleware.cli._main import DEFAULT_CONFIG
from sandbox_middleware.cli._process import with_layer

from .test_cli import row, run


def test_the_flags_place_and_set_the_layers() -> None:
    resolved = resolve_config(DEFAULT_CONFIG)
    warm = with_layer(with_layer(resolved, "warm_pool", {"size": 8}), "admission", {"max_create_rate": 5.0})
    names = [layer.name for layer in warm.middleware]
    assert names == [
        "tracing",
        "warm_pool",
        "metrics",
        "release_accounting",
        "retry",
        "retry",
        "admission",
        "ownership",
    ]
    assert warm.middleware[1].cls is WarmPoolMiddleware and warm.middleware[1].options == {"size": 8}
    assert warm.middleware[6].cls is AdmissionMiddleware and warm.middleware[6].options == {"max_create_rate": 5.0}
    bare = resolve_config({"provider": "local", "middleware": ["metrics"]})
    assert [layer.name for layer in with_layer(bare, "admission", {}).middleware] == ["metrics", "admission"]
    assert [layer.name for layer in with_layer(bare, "warm_pool", {"size": 1}).middleware] == ["warm_pool", "metrics"]


def test_run_with_a_pool_and_a_create_rate(tmp_path: Path) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text(f"""\
provider: {{local: {{isolation: none, base_dir: "{tmp_path / "boxes"}"}}}}
middleware: [tracing, metrics, release_accounting, retry, ownership]
""")
    done = run(
        "run",
        str(config),
        "--sessions",
        "30",
        "--concurrency",
        "6",
        "--commands",
        "1",
        "--warm",
        "4",
        "--max-create-rate",
        "40",
    )
    assert done.returncode == 0, done.stderr
    assert "2. warm_pool -> WarmPoolMiddleware(size=4)" in done.stderr
    assert "6. admission -> AdmissionMiddleware(max_create_rate=40.0)" in done.stderr
    assert row(done.stdout, "sessions ok / failed") == "30 / 0"
    assert row(done.stdout, "sandboxes still held") == "0"
    bad = run("run", "--max-create-rate", "0")
    assert bad.returncode == 2 and "--max-create-rate: must be a finite number of creates per second, above 0" in (
        bad.stderr
    )


def test_a_pool_beyond_its_bound_and_docker_without_an_image_are_usage_errors() -> None:
    """`--warm` is bounded as WarmPoolMiddleware's size is (a pool of 100,000 would be a fleet that
    outlives the run); `--provider docker` without `--image` fails before any session starts."""
    done = run("run", "--warm", "100000")
    assert done.returncode == 2 and "argument --warm: must be from 1 to 1024, not 100000" in done.stderr
    done = run("run", "--provider", "docker", "--sessions", "1")
    assert done.returncode == 2 and "argument --image: --provider docker needs the image" in done.stderr
    assert "sessions ok" not in done.stdout
