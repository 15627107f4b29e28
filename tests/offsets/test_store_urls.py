"""``--offsets`` URLs: which backend, which path, which schema."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import zbroker.storage.offsets as offsets_pkg
from zbroker.storage.offsets import InvalidOffsetsUrl, open_offset_store
from zbroker.storage.offsets.postgres import PostgresOffsetStore
from zbroker.storage.offsets.sqlite import SQLiteOffsetStore


@pytest.mark.parametrize("url, path, schema", [
    ("sqlite:///offsets.db", "offsets.db", None),
    ("sqlite:///data/offsets.db", "data/offsets.db", None),
    ("sqlite:////var/lib/zbroker/offsets.db", "/var/lib/zbroker/offsets.db", None),
    ("sqlite:///:memory:", ":memory:", None),
    ("sqlite:////tmp/o.db?schema=run_1", "/tmp/o.db", "run_1"),
])
def test_sqlite_urls(url, path, schema):
    store = open_offset_store(url)
    assert isinstance(store, SQLiteOffsetStore)
    assert (store.path, store.schema) == (path, schema)


@pytest.mark.parametrize("url, dsn, schema", [
    ("postgresql://postgres@127.0.0.1:5432/test", "postgresql://postgres@127.0.0.1:5432/test", None),
    ("postgres://u:p@db/x?schema=s1&sslmode=disable", "postgres://u:p@db/x?sslmode=disable", "s1"),
])
def test_postgres_urls(url, dsn, schema):
    store = open_offset_store(url)
    assert isinstance(store, PostgresOffsetStore)
    assert (store.dsn, store.schema) == (dsn, schema)


def test_the_schema_argument_wins_over_the_url():
    assert open_offset_store("sqlite:///o.db?schema=a", schema="b").schema == "b"


@pytest.mark.parametrize("url", ["mysql://x/y", "sqlite://relative.db", "sqlite:///", "offsets.db",
                                 "sqlite:///o.db?schema=bad-name", 'postgresql://h/db?schema=x";drop'])
def test_bad_urls_are_refused_with_a_clear_error(url):
    with pytest.raises(InvalidOffsetsUrl) as info:
        open_offset_store(url)
    assert info.value.code.value == "BAD_REQUEST"


# -- the package's import graph --------------------------------------------------------

_PACKAGE = "zbroker.storage.offsets"


def _sibling_imports(source: str) -> set[str]:
    """The modules of this package that `source` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(_PACKAGE + "."):
            found.add(node.module.removeprefix(_PACKAGE + "."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix(_PACKAGE + ".") for a in node.names
                         if a.name.startswith(_PACKAGE + "."))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as the list of its modules, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if (found := visit(nxt, path + [node])) is not None:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        if (found := visit(start, [])) is not None:
            return found
    return None


def _package_graph() -> dict[str, set[str]]:
    folder = Path(offsets_pkg.__file__).parent
    return {p.stem: _sibling_imports(p.read_text(encoding="utf-8"))
            for p in folder.glob("*.py") if p.stem != "__init__"}


def test_the_offsets_modules_import_no_circle():
    graph = _package_graph()
    assert graph["urls"] >= {"base"} and "urls" not in graph["base"]
    assert not graph["base"] & {"sqlite", "postgres", "urls"}
    assert _cycle(graph) is None


def test_the_cycle_check_finds_the_old_circle():
    # base used to import its backends inside open_offset_store; they import it back.
    graph = _package_graph()
    graph["base"] = graph["base"] | _sibling_imports(
        "def open_offset_store():\n    from zbroker.storage.offsets.sqlite import SQLiteOffsetStore\n")
    assert _cycle(graph) == ["base", "sqlite", "base"]


@pytest.mark.processes  # a fresh interpreter: this one may have imported asyncpg already
def test_a_sqlite_url_imports_no_postgres_driver():
    code = ("import sys\nfrom zbroker.storage.offsets import open_offset_store\n"
            "open_offset_store('sqlite:///:memory:')\n"
            "assert 'zbroker.storage.offsets.postgres' not in sys.modules\n"
            "assert 'asyncpg' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
