"""Structure rules of the ckptlib package, checked from its source (issue 16):

- no module over MAX_LINES lines;
- no import cycle among ckptlib modules, counting every import: module-level ones and
  function-local ones (a local import that dodges a cycle is still a cycle); only imports
  under ``if TYPE_CHECKING:`` (never executed) are left out;
- no two modules with the same file name (``convert.py`` twice made "which convert?" a question);
- private torch names (``torch._x`` attributes, also through names imported from torch;
  ``from torch... import _x``; ``torch._x`` modules; ``getattr(obj, "_x")`` on a torch object or
  a tensor's storage) only in ``ckptlib/_torch/``, the one package that knows torch internals;
- the packages stand in one order along the data flow (``LAYERS``): a module imports only
  from its own package or from packages below it;
- the top level holds the public API and few else (at most ``MAX_TOP_LEVEL`` files);
- every package's ``__init__`` docstring names each of its modules, and ``docs/architecture.md``
  names every package.
"""

from __future__ import annotations

import ast
import collections
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckptlib")
MAX_LINES = 800
TORCH_PRIVATE = "ckptlib/_torch/"


def _modules() -> dict[str, str]:
    """{dotted module name: file path} for every module of the package."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                path = os.path.join(dirpath, filename)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = path
    return found


MODULES = _modules()


def _rel(path: str) -> str:
    return os.path.relpath(path, os.path.dirname(ROOT)).replace(os.sep, "/")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _executed_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (their else branch does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imports(module: str, path: str) -> set[str]:
    """The ckptlib modules `module` imports anywhere in its body."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rsplit(".", 1)[0]
    out: set[str] = set()
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in _executed_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            names = [
                f"{base_name}.{alias.name}" if f"{base_name}.{alias.name}" in MODULES else base_name
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES and name != module and name.split(".")[0] == "ckptlib":
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_package_found():
    assert {"ckptlib", "ckptlib._torch", "ckptlib.format", "ckptlib.storage"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    path = MODULES[module]
    with open(path) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_LINES, f"{_rel(path)} has {lines} lines (at most {MAX_LINES}): split it along its seams"


def test_no_import_cycles():
    graph = {module: _imports(module, path) for module, path in MODULES.items()}
    cycles = _cycles(graph)
    shown = []
    for component in cycles:
        members = set(component)
        edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in members)
        shown.append("; ".join(edges))
    assert not cycles, "import cycles among ckptlib modules:\n" + "\n".join(shown)


def test_cycle_finder_sees_function_local_imports(tmp_path):
    """The rule is not vacuous: a cycle closed by a function-local import is found."""
    a = tmp_path / "a.py"
    a.write_text("from . import b\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from .a import x\n")
    saved = dict(MODULES)
    try:
        MODULES.update({"ckptlib.zz_a": str(a), "ckptlib.zz_b": str(b)})
        # (relative imports resolve against the module's own package, ckptlib)
        a.write_text("from . import zz_b\n")
        b.write_text("def f():\n    from .zz_a import x\n")
        graph = {m: _imports(m, MODULES[m]) for m in ("ckptlib.zz_a", "ckptlib.zz_b")}
        assert _cycles(graph) == [["ckptlib.zz_a", "ckptlib.zz_b"]]
        b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .zz_a import x\n")
        graph = {m: _imports(m, MODULES[m]) for m in ("ckptlib.zz_a", "ckptlib.zz_b")}
        assert _cycles(graph) == []
    finally:
        MODULES.clear()
        MODULES.update(saved)


def test_no_two_modules_share_a_name():
    by_name = collections.defaultdict(list)
    for path in MODULES.values():
        if not path.endswith("__init__.py"):
            by_name[os.path.basename(path)].append(_rel(path))
    same = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not same, f"modules sharing a file name: {same}"


def _private_torch_uses(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    torch_aliases = {"torch"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(p.startswith("_") for p in parts[1:]):
                    found.append(f"line {node.lineno}: import {alias.name}")
                if alias.name == "torch" and alias.asname:
                    torch_aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts[1:]):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            torch_aliases.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            torch_aliases.update(a.asname for a in node.names if a.asname and a.name.split(".")[0] == "torch")

    def torch_object(expr: ast.AST) -> bool:
        """An expression built from a torch name, or a tensor's storage (`t.untyped_storage()`)."""
        for sub in ast.walk(expr):
            if isinstance(sub, ast.Name) and sub.id in torch_aliases:
                return True
            if isinstance(sub, ast.Attribute) and sub.attr in ("untyped_storage", "storage", "_typed_storage"):
                return True
        return False

    for node in ast.walk(tree):
        if (  # getattr(<a torch object>, "_private")
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
            and torch_object(node.args[0])
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            chain = []
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_aliases:
                found.append(f"line {node.lineno}: {root.id}.{'.'.join(reversed(chain + [node.attr]))}")
    return found


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if not _rel(p).startswith(TORCH_PRIVATE)))
def test_private_torch_names_only_in_torch_package(module):
    uses = _private_torch_uses(MODULES[module])
    assert not uses, f"{_rel(MODULES[module])} touches private torch names (move them to {TORCH_PRIVATE}): {uses}"


@pytest.mark.parametrize("module", ["ckptlib._torch.dcp_shims", "ckptlib._torch.serialization"])
def test_private_torch_finder_is_not_vacuous(module):
    uses = _private_torch_uses(MODULES[module])
    assert uses, f"{_rel(MODULES[module])} is where torch's private names live; the finder should see some"


def test_storage_deletes_the_commit_markers_first():
    """storage/ names the files that make a directory committed without importing format/
    (data flows cli/manager -> format -> storage); the names must stay format's."""
    from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME
    from ckptlib.storage.base import DELETE_FIRST

    assert DELETE_FIRST == (MANIFEST_NAME, METADATA_NAME)


#: The packages (and top-level modules) from the bottom up: data flows down this list, from the
#: CLI to storage, and a module may import only from its own entry or from one further down.
LAYERS = (
    ("ckptlib._version", "ckptlib._scrub", "ckptlib.errors"),
    ("ckptlib._torch",),
    ("ckptlib.storage",),
    ("ckptlib._runtime",),
    ("ckptlib.format",),
    ("ckptlib.state",),
    ("ckptlib.dcp",),
    ("ckptlib.saving",),
    ("ckptlib.presets",),
    ("ckptlib.loading",),
    ("ckptlib.manager",),
    ("ckptlib.offline",),
    ("ckptlib.integrations",),
    ("ckptlib",),
    ("ckptlib.testing",),
    ("ckptlib.bench",),
    ("ckptlib.cli",),
)
MAX_TOP_LEVEL = 10


def _entry(module: str) -> str:
    """The entry of LAYERS that holds `module`: its top-level package or module."""
    return ".".join(module.split(".")[:2])


def _layer(module: str) -> int:
    entry = _entry(module)
    for level, names in enumerate(LAYERS):
        if entry in names:
            return level
    raise AssertionError(f"{module} is in no entry of LAYERS: place its package there")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_downward(module):
    """A module imports from its own package or from packages below it: no arrow back up."""
    up = sorted(
        imported
        for imported in _imports(module, MODULES[module])
        if _entry(imported) != _entry(module) and _layer(imported) > _layer(module)
    )
    assert not up, f"{_rel(MODULES[module])} imports {up}, above it in LAYERS"


def test_every_package_has_a_layer():
    assert sorted({_entry(m) for m in MODULES if _entry(m) != "ckptlib"} - {n for names in LAYERS for n in names}) == []


def test_top_level_holds_few_files():
    top = sorted(name for name in os.listdir(ROOT) if name.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL, f"ckptlib/ holds {len(top)} modules {top}: give each a package of its job"


def _package_docstring(package_dir: str) -> str:
    with open(os.path.join(package_dir, "__init__.py")) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


PACKAGES = sorted(
    dirpath for dirpath, _, filenames in os.walk(ROOT) if "__init__.py" in filenames and "__pycache__" not in dirpath
)


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda p: os.path.relpath(p, os.path.dirname(ROOT)))
def test_package_docstring_maps_its_modules(package_dir):
    """Each package's __init__ docstring says what each of its modules (and sub-packages) is for."""
    doc = _package_docstring(package_dir)
    names = sorted(
        name[: -len(".py")]
        for name in os.listdir(package_dir)
        if name.endswith(".py") and name not in ("__init__.py", "__main__.py")
    ) + sorted(d for d in os.listdir(package_dir) if os.path.isfile(os.path.join(package_dir, d, "__init__.py")))
    if package_dir == ROOT:
        names = [n for n in names if os.path.isfile(os.path.join(ROOT, n + ".py"))]
    missing = [n for n in names if f"`{n}`" not in doc and f"`{n}/`" not in doc and f"`{n}.py`" not in doc]
    assert missing == [], f"{_rel(package_dir)}/__init__.py's docstring does not name {missing}"


def test_architecture_names_every_package():
    with open(os.path.join(os.path.dirname(ROOT), "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    packages = sorted(os.path.relpath(p, os.path.dirname(ROOT)) + "/" for p in PACKAGES if p != ROOT)
    assert [p for p in packages if f"`{p}`" not in text] == [], "packages docs/architecture.md does not name"


# ---------------------------------------------------------------- no import cycle anywhere in the repository

REPO = os.path.dirname(ROOT)
#: Directories that hold no project code (virtualenvs, build output, caches, installed tools).
_NOT_CODE = {"build", "dist", "node_modules", "__pycache__"}


def _repo_files(repo: str) -> list[str]:
    """Every .py file of the repository (relative, '/'-separated): ckptlib, benchmarks, ci,
    examples, tests and anything else, except hidden, build and egg-info directories."""
    found = []
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and d not in _NOT_CODE and not d.endswith(".egg-info")
        )
        found += [os.path.relpath(os.path.join(dirpath, f), repo).replace(os.sep, "/") for f in filenames]
    return sorted(f for f in found if f.endswith(".py"))


def _dotted(rel: str, repo: str) -> str | None:
    """The module name a file is imported by as part of a package (its directory and every one
    above it up to the repository root hold an __init__.py), else None."""
    parts = rel[: -len(".py")].split("/")
    for depth in range(1, len(parts)):
        if not os.path.isfile(os.path.join(repo, *parts[:depth], "__init__.py")):
            return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _repo_import_graph(repo: str) -> dict[str, set[str]]:
    """{file: the repository files it imports}, counting function-local imports and leaving out
    those under `if TYPE_CHECKING:`. A dotted name resolves to a package module (ckptlib.x,
    relative imports too); a plain name also to a script beside the importer (sys.path[0] of a
    script) or, for a file under tests/, to the one file of that name anywhere under tests/
    (pytest puts every test directory on sys.path, and tests/conftest.py tests/ itself)."""
    files = _repo_files(repo)
    by_name = {name: rel for rel in files if (name := _dotted(rel, repo)) is not None}
    test_files = collections.defaultdict(list)
    for rel in files:
        if rel.startswith("tests/"):
            test_files[os.path.basename(rel)[: -len(".py")]].append(rel)

    def resolve(name: str, importer: str) -> str | None:
        if name in by_name:
            return by_name[name]
        if "." in name:
            return None
        here = os.path.dirname(importer)
        beside = f"{here}/{name}.py" if here else f"{name}.py"
        if beside in files:
            return beside
        if importer.startswith("tests/") and len(test_files[name]) == 1:
            return test_files[name][0]
        return None

    graph: dict[str, set[str]] = {}
    for rel in files:
        own = _dotted(rel, repo)
        package = (own if rel.endswith("__init__.py") else own.rpartition(".")[0]) if own else ""
        with open(os.path.join(repo, rel)) as f:
            tree = ast.parse(f.read(), rel)
        names: list[str] = []
        for node in _executed_nodes(tree):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                names += [f"{module}.{alias.name}" if module else alias.name for alias in node.names]
        targets = set()
        for name in names:
            while name:
                target = resolve(name, rel)
                if target is not None:
                    targets.add(target)
                    break
                name = name.rpartition(".")[0]
        graph[rel] = targets - {rel}
    return graph


def _cycle_report(graph: dict[str, set[str]]) -> list[str]:
    """One line per cycle: the imports that close it."""
    lines = []
    for component in _cycles(graph):
        members = set(component)
        lines.append("; ".join(sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in members)))
    return lines


def test_no_import_cycle_anywhere_in_the_repository():
    """The package, benchmarks, ci/, examples/ and tests/ (test modules importing each other
    count): no file reaches itself through imports."""
    graph = _repo_import_graph(REPO)
    assert {"ckptlib/cli/__init__.py", "ckptlib/bench/throughput.py", "tests/test_structure.py"} <= set(graph)
    cycles = _cycle_report(graph)
    assert not cycles, "import cycles in the repository:\n" + "\n".join(cycles)


def test_repository_cycle_finder_sees_every_kind_of_import(tmp_path):
    """The repository rule is not vacuous: a package cycle closed by a relative, function-local
    import, two test modules importing each other, and a test importing a helper at tests/ that
    imports it back are all found; an import under TYPE_CHECKING, a name that is no file of the
    repository and a test helper seen from outside tests/ are not edges."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from .. import top\n")
    (tmp_path / "pkg" / "top.py").write_text("import torch\n\ndef f():\n    from .sub import leaf\n")
    (tmp_path / "pkg" / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n"
    )
    (tmp_path / "tests" / "room").mkdir(parents=True)
    (tmp_path / "tests" / "helpers.py").write_text("import test_c\n")
    (tmp_path / "tests" / "room" / "test_a.py").write_text("from test_b import x\nimport pkg.sub.leaf\n")
    (tmp_path / "tests" / "room" / "test_b.py").write_text("def g():\n    import test_a\n")
    (tmp_path / "tests" / "room" / "test_c.py").write_text("from helpers import y\n")
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "tool.py").write_text("import helpers\nimport pkg\n")
    graph = _repo_import_graph(str(tmp_path))
    assert graph["pkg/top.py"] == {"pkg/sub/leaf.py"}
    assert graph["pkg/sub/__init__.py"] == {"pkg/top.py"}
    assert graph["pkg/sub/leaf.py"] == set()
    assert graph["tests/room/test_a.py"] == {"tests/room/test_b.py", "pkg/sub/leaf.py"}
    assert graph["tests/room/test_c.py"] == {"tests/helpers.py"}
    assert graph["ci/tool.py"] == {"pkg/__init__.py"}  # tests/helpers.py is not on a script's path in ci/
    assert graph["tests/helpers.py"] == {"tests/room/test_c.py"}
    assert sorted(_cycles(graph)) == [
        ["tests/helpers.py", "tests/room/test_c.py"],
        ["tests/room/test_a.py", "tests/room/test_b.py"],
    ]
    (tmp_path / "pkg" / "sub" / "leaf.py").write_text("def h():\n    from .. import top\n")
    assert ["pkg/sub/leaf.py", "pkg/top.py"] in _cycles(_repo_import_graph(str(tmp_path)))
