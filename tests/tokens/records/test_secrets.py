"""No secret of a store URL shows: not in the client's ``repr``, not in its errors (those of the
driver, which quote pieces of the URL, included), not in a traceback or a log, wherever libpq takes
it (the authority, ``?password=``, ``&sslpassword=`` and its other secret keys, percent-encoded keys
and values, key=value connection strings). The real URL still reaches the driver."""

from __future__ import annotations

import logging
import traceback

import pytest

from tests.postgres import require_postgres
from tests.tokens.records.helpers import make_record
from tests.vllm.server import free_port
from tokens.records import RecordStoreError, RecordWriter, open_store
from tokens.records._coordinates import Coordinates

pytestmark = pytest.mark.anyio


def _urls(port: int) -> dict[str, list[str]]:
    """Store URLs (a server that is not there), each with the secrets it holds."""
    at = f"127.0.0.1:{port}"
    return {
        f"postgresql://u:authsecret1@{at}/db": ["authsecret1"],
        f"postgresql://u@{at}/db?password=querysecret2": ["querysecret2"],
        f"postgresql://u@{at}/db?sslmode=disable&sslpassword=sslsecret3": ["sslsecret3"],
        f"postgresql://u@{at}/db?pass%77ord=encodedkey4": ["encodedkey4"],
        f"postgres://u@{at}/db?oauth_client_secret=oauthsecret5&password=pw%2Fsecret6": [
            "oauthsecret5",
            "pw%2Fsecret6",
            "pw/secret6",
        ],
        f"postgresql://u@{at}/db?scram_client_key=scramsecret7": ["scramsecret7"],
        # libpq refuses these and quotes the bad piece (the secret) in its message:
        f"postgresql://u@{at}/db?password=%zzbadsecret8": ["badsecret8"],
        f"postgresql://u:pw%zzbadsecret9@{at}/db": ["badsecret9"],
        f"postgresql://u:rawsecret10@{at}/db?password=querysecret11": ["rawsecret10", "querysecret11"],
    }


def _secret_free(text: str, secrets: list[str]) -> None:
    for secret in secrets:
        assert secret not in text, (secret, text)


async def test_no_secret_of_a_postgres_url_shows_in_repr_errors_tracebacks_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_postgres()  # psycopg (the driver whose messages are checked)
    caplog.set_level(logging.DEBUG)
    for url, secrets in _urls(free_port()).items():
        store = open_store(url)
        _secret_free(repr(store) + store.url, secrets)
        assert "***" in store.url
        with pytest.raises(RecordStoreError, match="cannot connect to PostgreSQL") as caught:
            await store.rollouts()
        error = caught.value
        _secret_free(str(error) + repr(error) + "".join(traceback.format_exception(error)), secrets)
        writer = RecordWriter(store)
        with pytest.raises(RecordStoreError) as begun:
            await writer.begin(Coordinates("r", "c"))
        _secret_free(str(begun.value), secrets)
        await writer.mark_failed(Coordinates("r", "c"))  # logs that the rollout could not be marked
        await store.close()
    _secret_free(caplog.text, [secret for secrets in _urls(0).values() for secret in secrets])
    assert "could not be marked incomplete" in caplog.text


async def test_a_key_value_connection_string_is_refused_without_its_secrets() -> None:
    """open_store takes URLs only; the message that says so quotes the string without its secrets."""
    for dsn, secrets in {
        "host=127.0.0.1 dbname=db password=kvsecret1": ["kvsecret1"],
        "host=127.0.0.1 password = 'kv secret\\'2' sslpassword=kvsecret3": ["kv secret'2", "secret", "kvsecret3"],
        "host=h PASSWORD=upper4": ["upper4"],
    }.items():
        with pytest.raises(RecordStoreError, match="unknown scheme") as caught:
            open_store(dsn)
        _secret_free(str(caught.value), secrets)
        assert "host=" in str(caught.value)


async def test_a_url_with_its_password_in_the_query_still_reaches_the_server(postgres_url: str) -> None:
    """What is hidden is only what is shown: the driver gets the URL whole (the cluster trusts every
    password, so a wrong one would still connect; a mangled URL would not)."""
    url = f"{postgres_url}?password=livesecret12&sslmode=disable"
    async with open_store(url) as store:
        await store.put(make_record("r", "c", [1], [2]))
        assert [summary.rollout_id for summary in await store.rollouts()] == ["r"]
        assert "livesecret12" not in repr(store)
        assert store.url.endswith("?password=***&sslmode=disable")
