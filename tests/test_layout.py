"""The architecture stays readable: the README's layout names every module in git, no module
imports another in a cycle, and ``tiering`` imports nothing from ``pretrain``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.helpers import REPO


def _modules() -> list[str]:
    out = subprocess.run(["git", "ls-files", "pretrain", "tiering"], capture_output=True, text=True, cwd=REPO).stdout
    return [p for p in out.split() if p.endswith(".py")]


def test_readme_layout_names_every_module() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    named: set[str] = set()
    folders: list[tuple[int, str]] = []  # the folders enclosing the current line, by indentation
    for line in block.splitlines():
        m = re.match(r"^( *)(.+?)(?:\s{2,}|$)", line)
        if not m or not m.group(2).strip():
            continue
        indent, entry = len(m.group(1)), m.group(2).strip()
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if entry.endswith("/"):
            folders.append((indent, entry))
            continue
        parent = "".join(f for _, f in folders)
        named |= {parent + name.strip() for name in entry.split(",") if name.strip().endswith(".py")}
    missing = [p for p in _modules() if p not in named and not p.endswith("__init__.py")]
    assert not missing, f"README layout does not name: {missing}"


def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def _top_level_imports(path: str) -> set[str]:
    """Project modules ``path`` imports at module level (deferred imports inside functions cannot cycle)."""
    tree = ast.parse((REPO / path).read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("pretrain", "tiering"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in ("pretrain", "tiering")}
    return out


def test_no_import_cycle() -> None:
    modules = {_module_name(p): p for p in _modules()}
    graph = {m: {i for i in _top_level_imports(p) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])


def test_every_module_imports() -> None:
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    mods = [_module_name(p) for p in _modules()]
    proc = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_tiering_imports_nothing_from_pretrain() -> None:
    for path in (REPO / "tiering").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) pretrain\b", text, re.M), path
