"""The README's token-capture and testing examples, run as written: scripts against the fake vLLM
served at localhost:8000, test modules with the plugin's fixtures."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import respx

from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

README = (Path(__file__).parents[2] / "README.md").read_text()
PART = README[README.index("## Token capture: `tokens`") : README.index("## Performance")]
BLOCKS = re.findall(r"```python\n(.*?)```", PART, flags=re.S)


@contextmanager
def fake_server(url: str) -> Iterator[FakeVLLM]:
    fake = FakeVLLM()
    with respx.mock(assert_all_called=False) as router:
        router.route(url__startswith=url).mock(side_effect=fake)
        yield fake


def fixture(name: str, stack: ExitStack) -> Any:
    if name == "fake_vllm":
        return stack.enter_context(fake_server(FAKE_VLLM_URL))
    if name == "fault_provider":
        return FaultInjectingProvider()
    if name == "telemetry":
        capture = TelemetryCapture()
        stack.callback(capture.shutdown)
        return capture
    raise AssertionError(f"a README test asks for an unknown fixture {name!r}")


def test_the_examples_are_found() -> None:
    assert len(BLOCKS) >= 8
    assert sum("def test_" in block for block in BLOCKS) == 3


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    if "def test_" not in code:
        compiled = compile(code, "<README example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

        async def run() -> None:
            result = eval(compiled, namespace)  # top-level await makes the module a coroutine
            if inspect.iscoroutine(result):
                await result

        with fake_server("http://localhost:8000"):
            anyio.run(run)
        return
    exec(compile(code, "<README test module>", "exec"), namespace)
    tests = [value for key, value in namespace.items() if key.startswith("test_") and callable(value)]
    assert tests
    for test in tests:
        with ExitStack() as stack:
            arguments = {name: fixture(name, stack) for name in inspect.signature(test).parameters}
            if inspect.iscoroutinefunction(test):
                anyio.run(lambda test=test, arguments=arguments: test(**arguments))
            else:
                test(**arguments)
