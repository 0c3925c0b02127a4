"""Test helpers for users of ``tokens``: a fake vLLM server (``FakeVLLM``) and its tokenizer, and the
same fake served over real HTTP (``FakeVLLMServer``; ``python -m tokens.testing.server`` on the
command line, scripted by ``read_script``'s JSON files).

The pytest plugin (installed with the package) gives a ``fake_vllm`` fixture: a ``FakeVLLM``
answering every request to ``http://fake-vllm.test`` through respx (``FAKE_VLLM_URL``).
"""

from ._errors import ScriptError
from ._fake_vllm import FakeTokenizer, FakeVLLM
from ._script import Script, read_script
from ._server import FakeVLLMServer

__all__ = ["FAKE_VLLM_URL", "FakeTokenizer", "FakeVLLM", "FakeVLLMServer", "Script", "ScriptError", "read_script"]

FAKE_VLLM_URL = "http://fake-vllm.test"
"""The base the ``fake_vllm`` fixture serves (``/v1`` for the OpenAI routes, ``/tokenize`` at the root)."""
