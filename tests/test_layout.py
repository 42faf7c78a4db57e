"""The package's layout holds: imports point down the layers only, with no cycle (counting imports
inside functions and under TYPE_CHECKING), maintenance reaches no mlx, and every module, function
and folder stays small enough to read in one sitting. Read from the source with `ast`: nothing
is imported to check it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvstore"

#: Lowest first. A module may import from its own layer's package and from layers below it.
LAYERS = [
    {"errors", "keys", "records", "sizes", "faults", "demo", "argv", "settings", "canary", "tenants", "trust"},
    {"storage"},
    {"restore"},
    {"upkeep"},
    {"remote"},
    {"events"},
    {"tiers"},
    {"write"},
    {"model"},
    {"certify"},
    {"store"},
    {"serve"},
    {"packs"},
    {"cli", "__main__"}  # (`python -m kvstore` runs the command),
]
#: What `kvstore stats`, `gc` and `verify` (and `--remote`) run, and so may never reach mlx (the
#: package itself too: importing any module of it runs `kvstore/__init__.py` first).
MAINTENANCE = ["kvstore", "kvstore.upkeep.local", "kvstore.upkeep.rebuild", "kvstore.remote.node", "kvstore.remote.s3"]
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_MODULES_PER_FOLDER = 500, 80, 12


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every kvstore module `name` imports, anywhere in it (functions and TYPE_CHECKING too)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("kvstore"):
                found.add(t)
    return found - {"kvstore"}


def _layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else name
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{name} is in no layer: add its folder to LAYERS")


def test_every_module_is_in_a_layer():
    for name in MODULES:
        if name != "kvstore":
            _layer(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "kvstore"))
def test_imports_point_down(name):
    for target in _imports(name):
        assert _layer(target) <= _layer(name), f"{name} imports {target}, a layer above it"


def test_no_import_cycle():
    graph = {name: _imports(name) for name in MODULES}
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [n, m]))
            if m not in state:
                visit(m, path + [n])
        state[n] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_maintenance_reaches_no_mlx():
    seen, todo = set(), list(MAINTENANCE)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse(MODULES[name].read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for m in mods:
                assert m.split(".")[0] not in ("mlx", "mlx_lm"), f"{name} imports {m}, reached from maintenance"
        todo += [t for t in _imports(name) if t not in seen]


def _architecture_rows() -> dict[str, str]:
    """docs/architecture.md's layer table: its first cell ("cli/", "store.py", "base") -> its text."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer | what it is |") :].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|", 1)]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def test_the_architecture_page_lists_every_module():
    rows = _architecture_rows()
    top = "`store.py` " + rows["store.py"] + rows["base"]
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(PACKAGE).as_posix()  # cli/pack, serve/tenancy: for a folder in a folder
        where = top if path.parent == PACKAGE else rows.get(f"{folder}/", "")
        assert f"`{path.name}`" in where, f"docs/architecture.md's table does not list {folder}/{path.name}"
    for key, text in rows.items():
        folder = PACKAGE / key.rstrip("/") if key.endswith("/") else PACKAGE
        for named in re.findall(r"`([a-z_]+\.py)`", text):
            assert (folder / named).exists(), f"docs/architecture.md's table names {key} {named}, which is gone"


def test_only_the_composition_root_subscribes_to_events():
    # The parts' events (the writer's `on_commit`, the memory tier's `on_change`, the disk tier's
    # `on_store`) carry what leaves a part; they are wired once, where the store is built.
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            owner = {"on_commit": "kvstore.write.writer", "on_queue": "kvstore.write.writer",
                     "on_unqueue": "kvstore.write.writer", "on_change": "kvstore.tiers.memory",
                     "on_store": "kvstore.tiers.disk"}.get(getattr(node, "attr", None))
            if isinstance(node, ast.Attribute) and owner and name not in ("kvstore.store", owner):
                raise AssertionError(f"{name} uses {node.attr}: subscribe in kvstore/store.py only")


def test_modules_functions_and_folders_stay_small():
    for name, path in MODULES.items():
        source = path.read_text()
        assert source.count("\n") <= MAX_MODULE_LINES, f"{name}: {source.count(chr(10))} lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= MAX_FUNCTION_LINES, f"{name}.{node.name}: {length} lines"
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder.name}/ holds {len(modules)} modules"


def test_every_remote_counter_counted_is_one_health_keeps():
    """A name `Health.count` is given that is not in `COUNTERS` raises KeyError where it is
    counted (an upload skipped for an unknown tenant was counted as an upload error)."""
    import re

    from kvstore.remote.health import COUNTERS

    used = set()
    for path in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"""health\.count\(\s*["']([a-z_]+)["']""", path.read_text()))
    assert used and used <= set(COUNTERS), sorted(used - set(COUNTERS))
