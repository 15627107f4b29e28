"""``--offsets`` URLs: which backend a URL names, and building that store.

This module sits above the backends, never below them: `base` holds the row
model and the interface, the backends (`sqlite`, `postgres`) import `base`, and
only this module knows the backends by name. It imports them lazily, from
`_BACKENDS`, so that naming a SQLite file does not import asyncpg and nothing
here is imported back by what it imports.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit

from zbroker.protocol.errors import ErrorCode, ZBrokerError
from zbroker.storage.offsets.base import OffsetStore

# Schema names end up quoted inside SQL text, so they are restricted to plain
# identifiers rather than escaped: a name that needs quoting is a mistake.
_SCHEMA_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class InvalidOffsetsUrl(ZBrokerError):
    """``--offsets`` names no backend we know, or an unusable schema."""

    code = ErrorCode.BAD_REQUEST


def check_schema(schema: str | None) -> str | None:
    if schema is not None and not _SCHEMA_RE.match(schema):
        raise InvalidOffsetsUrl(f"schema {schema!r} is not a plain identifier", schema=schema)
    return schema


def split_schema(url: str) -> tuple[str, str | None]:
    """Take a ``schema=`` query parameter out of `url`; the rest goes to the driver."""
    # By hand rather than urlunsplit, which rewrites "sqlite:///x" to "sqlite:/x".
    base, sep, query = url.partition("?")
    schema = None
    rest = []
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k == "schema":
            schema = v
        else:
            rest.append((k, v))
    return (base + "?" + urlencode(rest) if rest else base), schema


def _sqlite_target(url: str) -> str:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise InvalidOffsetsUrl("SQLite URL must look like sqlite:///path", url=url)
    return url[len(prefix):]  # SQLAlchemy's convention: a 4th slash makes it absolute


def _postgres_target(url: str) -> str:
    return url  # the DSN goes to asyncpg as it is


# scheme -> (module, class, what the class's first argument is made from the URL)
_BACKENDS: dict[str, tuple[str, str, Callable[[str], str]]] = {
    "sqlite": ("zbroker.storage.offsets.sqlite", "SQLiteOffsetStore", _sqlite_target),
    "postgresql": ("zbroker.storage.offsets.postgres", "PostgresOffsetStore", _postgres_target),
    "postgres": ("zbroker.storage.offsets.postgres", "PostgresOffsetStore", _postgres_target),
}


def open_offset_store(url: str, *, schema: str | None = None, **options) -> OffsetStore:
    """Build an (unconnected) store from an ``--offsets`` URL.

    ``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``sqlite:///:memory:``
    or ``postgresql://user@host:port/db`` (``postgres://`` too). A ``schema=``
    query parameter, or the `schema` argument (which wins), puts the tables in
    that schema: a PostgreSQL schema, or for SQLite an attached database file
    ``<path>.<schema>``. `options` go to the backend's constructor (timeouts).
    """
    if not isinstance(url, str):
        raise InvalidOffsetsUrl("offsets URL must be a string", got=type(url).__name__)
    url, url_schema = split_schema(url)
    schema = check_schema(schema if schema is not None else (url_schema or None))
    scheme = urlsplit(url).scheme.lower()
    backend = _BACKENDS.get(scheme)
    if backend is None:
        if not scheme:  # a bare path or name; it holds no password to keep out of the message
            raise InvalidOffsetsUrl(f"{url!r} is not a URL: use sqlite:///path or postgresql://user@host/db",
                                    url=url)
        raise InvalidOffsetsUrl(f"unknown offsets backend {scheme!r}; use sqlite:/// or postgresql://",
                                scheme=scheme)
    module, name, target = backend
    where = target(url)  # checked before the import, so a bad URL costs no driver import
    store_class = getattr(importlib.import_module(module), name)
    return store_class(where, schema=schema, **options)
