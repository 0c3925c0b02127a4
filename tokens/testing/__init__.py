"""Test helpers for users of ``tokens``: a fake vLLM server (``FakeVLLM``) and its tokenizer.

The pytest plugin (installed with the package) gives a ``fake_vllm`` fixture: a ``FakeVLLM``
answering every request to ``http://fake-vllm.test`` through respx (``FAKE_VLLM_URL``).
"""

from ._fake_vllm import FakeTokenizer, FakeVLLM

__all__ = ["FAKE_VLLM_URL", "FakeTokenizer", "FakeVLLM"]

FAKE_VLLM_URL = "http://fake-vllm.test"
"""The base the ``fake_vllm`` fixture serves (``/v1`` for the OpenAI routes, ``/tokenize`` at the root)."""
