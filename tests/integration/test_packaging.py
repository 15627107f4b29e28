"""The wheel installs one package, ``zbroker``: no bare actors/protocol/storage/bench.

Built from a copy of the checkout (an in-tree build would write build/ and
*.egg-info under the repository while other tests run), offline with the
venv's own setuptools (``--no-build-isolation``), then read as a zip.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
BARE = {"actors", "protocol", "storage", "bench"}
SKIP = shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "*.egg-info", "__pycache__",
                              ".pytest_cache", ".hypothesis", "data", "keys", "results")


def bare_imports(source: str) -> set[str]:
    """Top-level names among BARE that a module imports absolutely (`import protocol.x`, `from storage import y`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & BARE


def test_bare_imports_sees_each_spelling():
    # The check below would pass vacuously if this missed an import form.
    assert bare_imports("import protocol.codec\nfrom storage.log import x\nimport bench as b\n"
                        "from actors import runtime\n") == BARE
    assert bare_imports("from zbroker.protocol import codec\nfrom . import storage\nimport zbroker.actors\n") == set()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("zbroker", "actors", "protocol", "storage", "bench"):
        shutil.copytree(REPO / folder, src / folder, ignore=SKIP)
    out = tmp / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("zbroker-*.whl")
    with zipfile.ZipFile(built) as whl:
        yield whl


def test_the_wheel_has_zbroker_alone_at_the_top_level(wheel):
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["zbroker"]
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"zbroker"}
    assert not [n for n in wheel.namelist() if "bench" in n.split("/")], "bench/ is not shipped"


def test_the_wheel_carries_the_offset_store_migrations(wheel):
    shipped = {Path(n).name for n in wheel.namelist() if n.startswith("zbroker/storage/offsets/migrations/")
               and n.endswith(".sql")}
    assert shipped == {p.name for p in (REPO / "storage" / "offsets" / "migrations").glob("*.sql")}
    assert shipped


def test_no_module_in_the_wheel_imports_a_bare_top_level_name(wheel):
    offenders = {name: sorted(bare) for name in wheel.namelist() if name.endswith(".py")
                 if (bare := bare_imports(wheel.read(name).decode()))}
    assert offenders == {}


def test_the_wheel_carries_the_console_templates_and_vendored_charts(wheel):
    names = set(wheel.namelist())
    console = REPO / "zbroker" / "console"
    for folder in ("templates", "static"):
        for path in (console / folder).iterdir():
            assert f"zbroker/console/{folder}/{path.name}" in names
