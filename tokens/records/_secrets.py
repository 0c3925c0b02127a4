"""What a record store shows of its URL: never a secret libpq knows, wherever the URL puts it.

libpq takes a secret in the authority (``postgresql://user:SECRET@host/db``), as a query parameter
(``?password=SECRET``, ``&sslpassword=SECRET``, its key even percent-encoded) and in key=value
connection strings (``password=SECRET``, ``password = 'SE CRET'``). ``StoreSecrets(url)`` finds
them all: ``shown`` is the URL with each replaced by ``***`` (for ``repr`` and messages), and
``hide(text)`` does the same to any text, such as the driver's own error, which may quote a piece of
the URL (``invalid percent-encoded token: "..."``) where no pattern finds it: every secret value
found in the URL is replaced wherever it appears.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["SECRET_KEYS", "StoreSecrets"]

SECRET_KEYS = frozenset({"password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key"})
"""libpq's options that hold secrets: those ``PQconndefaults`` marks ``*`` (shown as a password) and the
SCRAM keys (which authenticate as the password does)."""

_MASK = "***"
# libpq: the userinfo ends at the first '@' before the first '/'; the password follows its first ':'.
_AUTHORITY = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/@:\s]*:)([^/@\s]*)@")
_QUERY = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
_KEYWORD = re.compile(r"(?<![^\s'\"(,;])([A-Za-z_%][A-Za-z0-9_%]*)(\s*=\s*)('(?:[^'\\]|\\.)*'?|\S*)")
_SHORT = 4  # a secret shorter than this is hidden only where it stands as a whole word in the text


class StoreSecrets:
    """The secrets of one store URL: ``shown`` (the URL without them) and ``hide`` (any text without them)."""

    def __init__(self, url: str) -> None:
        self._values: set[str] = set()
        self.shown = self.hide(url)

    def hide(self, text: str) -> str:
        """``text`` with every secret that the patterns find, or that the URL held, replaced by ``***``."""
        text = _AUTHORITY.sub(self._authority, text)
        text = _QUERY.sub(self._query, text)
        text = _KEYWORD.sub(self._keyword, text)
        for value in sorted(self._values, key=len, reverse=True):
            if len(value) >= _SHORT:
                text = text.replace(value, _MASK)
            else:
                text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", _MASK, text)
        return text

    def _found(self, value: str, *forms: str) -> str:
        self._values.update(form for form in (value, *forms) if form and form != _MASK)
        return _MASK

    def _authority(self, match: re.Match[str]) -> str:
        value = match.group(2)
        return f"{match.group(1)}{self._found(value, unquote(value))}@"

    def _query(self, match: re.Match[str]) -> str:
        separator, key, value = match.groups()
        if unquote(key).lower() not in SECRET_KEYS:
            return match.group(0)
        return f"{separator}{key}={self._found(value, unquote(value))}"

    def _keyword(self, match: re.Match[str]) -> str:
        key, equals, value = match.groups()
        if unquote(key).lower() not in SECRET_KEYS:
            return match.group(0)
        bare = re.sub(r"\\(.)", r"\1", value[1:].removesuffix("'")) if value.startswith("'") else value
        return f"{key}{equals}{self._found(value, bare)}"
