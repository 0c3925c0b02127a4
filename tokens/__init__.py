"""Token capture for OpenAI-compatible chat completions."""

__all__: list[str] = []
