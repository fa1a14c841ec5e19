"""Secrets never printed (nugget_rag/state/redaction.py, by name and by shape, wherever settings are printed), and
"does not answer" said of connection errors alone (integrations/stores/user_store.py's `unreachable`)."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest
from langchain_core.vectorstores import InMemoryVectorStore
from test_integrations import HashEmbeddings

from nugget_rag import cli
from nugget_rag.integrations import EngineUnavailable, VectorStoreSpec
from nugget_rag.integrations.stores.user_store import answering, unreachable
from nugget_rag.serving.errors import failure
from nugget_rag.state.redaction import redacted, secret_name
from nugget_rag.state.store import StoreLocation

SECRET = "SEKRET123"
RAISED: dict[str, BaseException] = {}  # what `failing_store` raises, by the test


def failing_store(**settings) -> None:
    """A vector store factory (for VectorStoreSpec) whose engine fails as the test says."""
    raise RAISED["error"]


def spec(kwargs: dict) -> VectorStoreSpec:
    return VectorStoreSpec(target="test_redaction:failing_store", kwargs=kwargs)


def refused_message(kwargs: dict) -> str:
    RAISED["error"] = ConnectionRefusedError(111, "Connection refused")
    with pytest.raises(EngineUnavailable) as raised:
        spec(kwargs).build(HashEmbeddings())
    return str(raised.value)


@pytest.mark.parametrize("name", ["password", "api_key", "apiKey", "X-Api-Key", "token", "access_token", "secret",
                                  "client_secret", "credentials", "auth", "http_auth", "Authorization", "PGPASSWORD"])
def test_secret_names(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", ["url", "collection_name", "max_tokens", "tokenizer", "author", "timeout", "host"])
def test_names_that_hold_no_secret(name):
    assert not secret_name(name)


def test_the_engine_down_command_prints_no_api_key(compressor, monkeypatch, capsys, tmp_path):
    """issue 82's command: a key named api_key, deep in the settings, is starred in the error the CLI prints."""
    kwargs = {"collection_name": "docs", "client_options": {"url": "http://127.0.0.1:1", "api_key": SECRET}}
    message = refused_message(kwargs)
    assert SECRET not in message and '"api_key": "***"' in message and "http://127.0.0.1:1" in message
    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: compressor)
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    (tmp_path / "a.txt").write_text("a document")
    assert cli.main(["ingest", str(tmp_path / "a.txt"), "--index", str(tmp_path / "ix"), "--vectorstore",
                     "test_redaction:failing_store", "--vectorstore-kwargs", json.dumps(kwargs)]) == 2
    err = capsys.readouterr().err
    assert "does not answer" in err and SECRET not in err


@pytest.mark.parametrize("url, shown", [
    (f"postgresql+psycopg://app@db:5432/docs?sslmode=require&password={SECRET}",
     "postgresql+psycopg://***@db:5432/docs?sslmode=require&password=***"),  # a userinfo without a password too
    (f"postgresql+psycopg://app:{SECRET}@db:5432/docs", "postgresql+psycopg://app:***@db:5432/docs"),
    (f"postgresql+psycopg://app:p@{SECRET}@db/docs", "postgresql+psycopg://app:***@db/docs"),  # an unencoded "@"
    (f"https://db.example/?api_key={SECRET}&x=1", "https://db.example/?api_key=***&x=1"),
    (f"https://{SECRET}@db.example/v1", "https://***@db.example/v1"),  # a token as the userinfo
])
def test_a_url_prints_no_secret_in_its_userinfo_or_query(url, shown):
    message = refused_message({"connection": url})
    assert SECRET not in message and shown in message
    assert redacted(f"could not connect to '{url}'.") == f"could not connect to '{shown}'."


def test_starring_keeps_the_text_around_a_url_and_twice_is_once():
    """The CLI stars a message already starred (its settings as JSON): the JSON's quotes and braces stay."""
    text = json.dumps({"connection": f"postgresql+psycopg://app@db/x?password={SECRET}"}) + "): refused."
    once = redacted(text)
    assert once == '{"connection": "postgresql+psycopg://***@db/x?password=***"}): refused.' and redacted(once) == once
    assert redacted(f'{{"a":"http://u:{SECRET}@h","b":"redis://:{SECRET}@h:1/0"}}') == \
        '{"a":"http://u:***@h","b":"redis://:***@h:1/0"}'


def test_a_connection_string_and_a_nested_list_print_no_secret():
    settings = {"dsn": f"host=db password={SECRET} dbname=docs", "replicas": [{"token": SECRET, "port": 1}]}
    assert redacted(settings) == {"dsn": "host=db password=*** dbname=docs", "replicas": [{"token": "***", "port": 1}]}


def test_an_engine_address_is_printed_without_its_secrets():
    store = InMemoryVectorStore(HashEmbeddings())
    store.client = SimpleNamespace(init_options={"url": f"http://admin:{SECRET}@127.0.0.1:1?token={SECRET}"})
    with pytest.raises(EngineUnavailable) as raised, answering(store, "add 1 chunk"):
        raise ConnectionRefusedError(111, f"Connection refused (http://admin:{SECRET}@127.0.0.1:1)")
    assert SECRET not in str(raised.value) and "http://admin:***@127.0.0.1:1?token=***" in str(raised.value)


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@127.0.0.1:1/0", f"redis://u:p@{SECRET}@127.0.0.1:1/0",
                                 f"redis://127.0.0.1:1/0?password={SECRET}"])
def test_a_redis_store_url_prints_no_password(url):
    location = StoreLocation.parse(url)
    assert SECRET not in str(location) and "127.0.0.1:1" in str(location)
    with pytest.raises(OSError) as raised:
        location.open()
    assert SECRET not in str(raised.value) and "cannot reach Redis at redis://" in str(raised.value)


def test_an_error_response_prints_no_secret():
    status, message = failure(RuntimeError(f"lost postgresql://u:{SECRET}@db/x"), 30)
    assert status == 500 and SECRET not in message and "postgresql://u:***@db/x" in message


# ------------------------------------------------------------------ "does not answer": connection errors alone
class OperationalError(Exception):
    """As SQLAlchemy and psycopg name theirs: the engine's message says what failed."""


class ResponseHandlingException(Exception):
    """As qdrant-client wraps a transport error: raised while handling it, holding it."""


def wrapped(inner: BaseException) -> BaseException:
    try:
        raise inner
    except BaseException as err:
        try:
            raise ResponseHandlingException(err)
        except ResponseHandlingException as outer:
            return outer


def handling(inner: BaseException, outer: BaseException) -> BaseException:
    """`outer`, raised while `inner` was being handled (not from it, not holding it)."""
    try:
        try:
            raise inner
        except BaseException:
            raise outer
    except BaseException as err:
        return err


@pytest.mark.parametrize("err", [
    ConnectionRefusedError(111, "Connection refused"), ConnectionResetError(104, "Connection reset by peer"),
    TimeoutError("timed out"), socket.gaierror(-2, "Name or service not known"),
    wrapped(ConnectionRefusedError(111, "Connection refused")),
    OperationalError('connection to server at "127.0.0.1", port 1 failed: Connection refused'),
    OperationalError("failed to resolve host 'nowhere': [Errno -2] Name or service not known"),
], ids=["refused", "reset", "timeout", "name resolution", "wrapped", "psycopg refused", "psycopg resolution"])
def test_connection_errors_are_an_engine_that_does_not_answer(err):
    assert unreachable(err)


@pytest.mark.parametrize("err", [
    PermissionError(13, "Permission denied", "/srv/chroma"), FileNotFoundError(2, "No such file", "/srv/chroma"),
    OSError(28, "No space left on device"),
    OperationalError('password authentication failed for user "app"'),
    handling(ConnectionRefusedError(111, "Connection refused"), KeyError("collection")),
], ids=["permission", "missing file", "disk full", "wrong password", "raised while handling"])
def test_other_errors_are_not_an_engine_that_does_not_answer(err):
    assert not unreachable(err)


def test_another_error_keeps_its_message_and_type():
    RAISED["error"] = PermissionError(13, "Permission denied", "/srv/chroma")
    with pytest.raises(PermissionError, match="Permission denied") as raised:
        spec({"persist_directory": "/srv/chroma"}).build(HashEmbeddings())
    assert not isinstance(raised.value, EngineUnavailable)
    store = InMemoryVectorStore(HashEmbeddings())
    with pytest.raises(FileNotFoundError, match="No such file"), answering(store, "add 1 chunk"):
        raise FileNotFoundError(2, "No such file", "/srv/chroma")
