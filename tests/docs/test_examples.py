"""The examples of README.md and of every docs/*.md page, run as written; and the pages' links and paths.

Which blocks run, and how
-------------------------
Every fenced block opened by exactly ```python is an example. Each runs in a fresh module of its own,
in a temporary working directory of its own, and a test fails when its example raises:

- a block that defines ``def test_...`` is a test module: each of its test functions runs with the
  fixtures the distribution's pytest plugin gives (``fake_vllm``, ``fault_provider``, ``telemetry``,
  ``capture_proxy``),
  async ones under anyio (asyncio);
- any other block is a script and may use top-level ``await`` (as in ``python -m asyncio`` or a
  notebook). On a page that says to paste its examples into ``python -m asyncio`` (README.md and the
  token pages), a script is pasted there as a user does it: its text, verbatim, on the stdin of a
  ``python -m asyncio`` process (which reads it as the REPL reads a paste: a block ends at a blank
  line), followed by the Enter a user presses last; it fails when that prints anything but the
  REPL's banner on stderr (a traceback, a ``SyntaxError``) or does not reach its end. Its vLLM is
  ``python -m tokens.testing.server``, started by this test as a process on a free port (one per
  module), and its capture proxy ``python -m tokens.proxy`` started with the command of
  docs/proxy.md in front of it: the URLs the pages give, ``http://localhost:8000`` (vLLM's port) and
  ``http://127.0.0.1:9000`` (the proxy's), are replaced by theirs, the one change made to the text.
  A script on any other page runs in this process with a ``FakeVLLM`` (``tokens.testing``)
  answering ``http://localhost:8000`` and ``FAKE_VLLM_URL`` through respx; any other request made
  through httpx fails.

An HTML comment on the line before a block's opening fence (blank lines between are allowed) changes
that; it is invisible on a rendered page and plain to anyone editing one:

- ``<!-- not run: REASON -->``: the block does not run; it is reported as a skipped test saying
  REASON. Keep these rare and justified (a Ray cluster, an API that lands in another branch):
  ``test_not_run_blocks_are_rare`` caps their number.
- ``<!-- file: NAME -->``: the block (any language, e.g. a YAML config) is written to NAME in the
  working directory of every example of the same page before it runs, so an example can load it.

An example that constructs a ``LocalProvider`` needs bubblewrap: where ``bwrap`` is not on PATH it is
skipped, saying to ``apt-get install bubblewrap``; with ``REQUIRE_BWRAP=1`` (CI) that is a failure.
One that constructs a ``DockerProvider`` needs a Docker daemon (the test images are built when
missing): it is skipped in one line where none answers; with ``REQUIRE_DOCKER=1`` that is a failure.

A traceback from an example run in this process names the Markdown page and the line of the
failing statement; a pasted one's failure names the page and line of the block, with the REPL's output.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import shlex
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import respx

from pytest_llm_sandbox_middleware import running_capture_proxy
from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests import ROOT
from tests.bwrap import bwrap_problem, unavailable
from tests.sandbox.providers.docker._support import require_docker
from tests.served import environment, served
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT_SERVERS = ("http://localhost:8000", FAKE_VLLM_URL)  # where a script example may find vLLM
VLLM_URLS = ("http://localhost:8000", "http://127.0.0.1:8000")  # vLLM's, in a pasted example
PROXY_URL = "http://127.0.0.1:9000"  # the capture proxy's, in a pasted example
PASTE_TIMEOUT_S = 180
MAX_NOT_RUN = 4

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(not run|file):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where its code starts (1-based line), its language, its marker."""

    page: Path
    line: int
    lang: str
    code: str
    not_run: str | None = None
    file: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{page.relative_to(ROOT)}:{index + 1}: a code block is never closed"
        above = index - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = MARKER.match(lines[above].strip()) if above >= 0 else None
        kind, value = marker.groups() if marker else (None, None)
        found.append(
            Block(
                page,
                index + 2,
                opening.group(1),
                "\n".join(lines[index + 1 : end]) + "\n",
                not_run=value if kind == "not run" else None,
                file=value if kind == "file" else None,
            )
        )
        index = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
EXAMPLES = [block for block in BLOCKS if block.lang == "python"]
PASTED_PAGES = {page for page in PAGES if "`python -m asyncio`" in page.read_text()}
"""The pages that tell the reader to paste their examples into ``python -m asyncio``."""


@contextmanager
def fake_vllm_at(*urls: str) -> Iterator[FakeVLLM]:
    fake = FakeVLLM()
    with respx.mock(assert_all_called=False) as router:
        for url in urls:
            router.route(url__startswith=url).mock(side_effect=fake)
        router.route(host="docker").pass_through()  # DockerProvider's Engine API calls, on its UNIX socket
        yield fake


def fixture(name: str, stack: ExitStack) -> Any:
    """What the distribution's pytest plugin gives a test of that name."""
    if name == "fake_vllm":
        return stack.enter_context(fake_vllm_at(FAKE_VLLM_URL))
    if name == "fault_provider":
        return FaultInjectingProvider()
    if name == "capture_proxy":
        return stack.enter_context(running_capture_proxy())
    if name == "telemetry":
        capture = TelemetryCapture()
        stack.callback(capture.shutdown)
        return capture
    raise AssertionError(f"an example test asks for a fixture the plugin does not give: {name!r}")


@contextmanager
def example_module(block: Block, number: int) -> Iterator[types.ModuleType]:
    """A real module for the example (dataclasses, pickling and typing look classes up in sys.modules)."""
    module = types.ModuleType(f"docs_example_{number}")
    module.__file__ = str(block.page)
    sys.modules[module.__name__] = module
    try:
        yield module
    finally:
        del sys.modules[module.__name__]


def compiled(block: Block, flags: int = 0) -> types.CodeType:
    # Padded so that line numbers in a traceback are the page's own.
    code: types.CodeType = compile(
        "\n" * (block.line - 1) + block.code, str(block.page), "exec", flags=flags, dont_inherit=True
    )
    return code


def require_bwrap() -> None:
    """The one skip line of ``tests/bwrap.py`` where bubblewrap cannot run (a failure with REQUIRE_BWRAP=1)."""
    problem = bwrap_problem()
    if problem is not None:
        unavailable(problem)


def run_script(block: Block, module: types.ModuleType) -> None:
    code = compiled(block, ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

    async def run() -> None:
        result = eval(code, module.__dict__)  # top-level await makes the module body a coroutine
        if inspect.iscoroutine(result):
            await result

    with fake_vllm_at(*SCRIPT_SERVERS):
        anyio.run(run)


def run_test_module(block: Block, module: types.ModuleType) -> None:
    exec(compiled(block), module.__dict__)
    tests = [value for name, value in vars(module).items() if name.startswith("test_") and callable(value)]
    assert tests, f"{block.where}: a block with 'def test_' defines no test function"
    for test in tests:
        with ExitStack() as stack:
            arguments = {name: fixture(name, stack) for name in inspect.signature(test).parameters}
            if inspect.iscoroutinefunction(test):
                anyio.run(functools.partial(test, **arguments))
            else:
                test(**arguments)


def is_test_module(block: Block) -> bool:
    return re.search(r"^\s*(async\s+)?def test_", block.code, flags=re.M) is not None


def proxy_command() -> list[str]:
    """docs/proxy.md's command that starts the proxy in front of a fake vLLM (after its own start)."""
    [first] = [block for block in BLOCKS if block.page.name == "proxy.md" and block.lang == "bash"][:1]
    lines = [line.partition("#")[0].strip() for line in first.code.splitlines()]
    assert "python -m tokens.testing.server &" in lines, "docs/proxy.md starts the fake vLLM before the proxy"
    [command] = [shlex.split(line) for line in lines if line.startswith("python -m tokens.proxy ")]
    return command


@pytest.fixture(scope="module")
def served_vllm() -> Iterator[str]:
    """``python -m tokens.testing.server`` on a free port, as a process: its root URL."""
    with served(["-m", "tokens.testing.server", "--port", "0"]) as url:
        yield url.removesuffix("/v1")


@pytest.fixture(scope="module")
def served_proxy(served_vllm: str) -> Iterator[str]:
    """docs/proxy.md's ``python -m tokens.proxy ...`` in front of the served fake, on a free port: its root URL."""
    pytest.importorskip("starlette", reason="the capture proxy needs its extra: pip install -e '.[proxy]'")
    command = proxy_command()
    assert command[:3] == ["python", "-m", "tokens.proxy"] and "--port" in command, command
    upstream, port = command.index("--upstream") + 1, command.index("--port") + 1
    assert command[upstream] == VLLM_URLS[1] + "/v1" and command[port] == PROXY_URL.rpartition(":")[2], command
    command[upstream], command[port] = served_vllm + "/v1", "0"
    with served(command[1:]) as url:
        yield url


def paste(block: Block, cwd: Path, urls: dict[str, str]) -> None:
    """The block pasted into ``python -m asyncio`` (then Enter, then a line that says it got to the end)."""
    code = block.code
    for written, actual in urls.items():
        code = code.replace(written, actual)
    end = f"end of {block.where}"
    done = subprocess.run(
        [sys.executable, "-m", "asyncio"],
        input=f"{code}\nprint({end!r})\n",
        capture_output=True,
        text=True,
        timeout=PASTE_TIMEOUT_S,
        cwd=cwd,
        env=environment(),
    )
    banner = ("asyncio REPL ", 'Use "await" directly', 'Type "help"', ">>> import asyncio", "exiting asyncio REPL")
    printed = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(banner)]
    assert done.returncode == 0 and not printed and end in done.stdout, (
        f"{block.where}: pasted into python -m asyncio, it printed on stderr:\n{done.stderr}\nand on stdout:\n"
        f"{done.stdout}"
    )


@pytest.mark.parametrize("block", EXAMPLES, ids=[block.where for block in EXAMPLES])
def test_example_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if block.not_run is not None:
        pytest.skip(f"{block.where} not run: {block.not_run}")
    if "LocalProvider(" in block.code:
        require_bwrap()
    if "DockerProvider(" in block.code:
        require_docker()  # a daemon and the test images (built here when missing), or one skip line
    for other in BLOCKS:
        if other.page == block.page and other.file is not None:
            (tmp_path / other.file).write_text(other.code)
    if block.page in PASTED_PAGES and not is_test_module(block):
        vllm = request.getfixturevalue("served_vllm")
        urls = dict.fromkeys(VLLM_URLS, vllm)
        if PROXY_URL in block.code:
            urls[PROXY_URL] = request.getfixturevalue("served_proxy")
        paste(block, tmp_path, urls)
        return
    monkeypatch.chdir(tmp_path)
    with example_module(block, EXAMPLES.index(block)) as module:
        if is_test_module(block):
            run_test_module(block, module)
        else:
            run_script(block, module)


def test_the_examples_are_found() -> None:
    pages = {block.page.name for block in EXAMPLES}
    assert "README.md" in pages
    assert len(pages) >= 10, f"examples on only {sorted(pages)}"
    assert len(EXAMPLES) >= 25
    assert sum("def test_" in block.code for block in EXAMPLES) >= 3


def test_every_example_that_needs_vllm_is_pasted_against_the_served_fake() -> None:
    """A script example that talks to vLLM (or to the proxy) sits on a page that says to paste it into
    ``python -m asyncio``, so it runs as pasted against ``python -m tokens.testing.server``."""
    pages = {block.page.name for block in EXAMPLES if block.page in PASTED_PAGES}
    assert {"README.md", "token-capture.md", "records.md", "proxy.md"} <= pages
    servers = (*VLLM_URLS, PROXY_URL)
    elsewhere = [
        block.where
        for block in EXAMPLES
        if block.not_run is None
        and not is_test_module(block)
        and block.page not in PASTED_PAGES
        and any(url in block.code for url in servers)
    ]
    assert not elsewhere, f"examples that need vLLM on pages that do not say to paste them: {elsewhere}"


def test_not_run_blocks_are_rare() -> None:
    not_run = [f"{block.where} ({block.not_run})" for block in EXAMPLES if block.not_run is not None]
    assert all(block.not_run for block in EXAMPLES if block.not_run is not None), "a not-run marker needs a reason"
    assert len(not_run) <= MAX_NOT_RUN, f"{len(not_run)} examples are not run: {not_run}"


def test_markers_sit_on_the_blocks_they_mean() -> None:
    misplaced = [block.where for block in BLOCKS if block.not_run is not None and block.lang != "python"]
    misplaced += [
        block.where for block in BLOCKS if block.file is not None and not re.fullmatch(r"[\w.-]+", block.file)
    ]
    assert not misplaced, "a not-run marker on a block that is not ```python, or a file marker that is not a plain name"


def test_every_python_block_is_marked_as_python() -> None:
    """```py, ```python3 or ```pycon would escape the run above: spell it ```python."""
    odd = [block.where for block in BLOCKS if block.lang in {"py", "python3", "pycon", "Python", "py3"}]
    assert not odd, f"python blocks not opened by ```python: {odd}"


def test_the_readme_shows_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e . && sandbox-middleware run --sessions 200 --concurrency 32\n" in readme
    assert "pip install -e '.[test]' && python -m pytest\n" in readme  # CI greps the README for it


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page."""
    found = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower().replace("`", "")
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked)
        if not linked.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"links to nothing: {broken}"


REPO_PATH = re.compile(
    r"(?<![\w./<-])((?:tests|bench|scripts|examples|docs|sandbox_middleware|tokens|_shared_telemetry|"
    r"pytest_llm_sandbox_middleware|\.ci)/[\w./-]*[\w/])"
)


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_paths_named_exist(page: Path) -> None:
    """Every file or directory of this repository a page names (``tests/...``, ``bench/...``) exists."""
    missing = sorted({path for path in REPO_PATH.findall(page.read_text()) if not (ROOT / path).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_page_is_in_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    pages = [page.name for page in PAGES if page.parent.name == "docs" and page.name != "README.md"]
    assert pages
    assert not [name for name in pages if f"({name})" not in index], "docs/README.md must link every page"
    assert not [name for name in pages if f"(docs/{name})" not in readme], "README.md must link every page"


@pytest.mark.requires_bwrap
def test_the_quickstart_example_runs() -> None:
    """``examples/quickstart.py``, which the README points to, runs as a user would run it."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "-> create",
        "-> exec: echo hello from $(pwd)",
        "<- exit 0",
        "hello from /workspace",
        "-> close",
    ]
