"""The architecture stays readable: docs/layout.md names every module in git and no module that is
gone, the README's layout lists exactly the tracked top-level folders and the subpackages of
``pretrain`` and ``tiering``, no module imports another in a cycle, and ``tiering`` imports nothing
from ``pretrain``, and the top of ``tiering`` stays the digest and manifest core (at most
:data:`TIERING_TOP_LEVEL_MAX` modules; everything else in the subpackage of its concern)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.helpers import REPO

TIERING_TOP_LEVEL_MAX = 10  # .py files directly in tiering/, __init__.py and __main__.py included


def _tracked(*paths: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *paths], capture_output=True, text=True, cwd=REPO).stdout.split()


def _modules() -> list[str]:
    return [p for p in _tracked("pretrain", "tiering") if p.endswith(".py")]


def _layout_entries(markdown: str) -> list[str]:
    """Full paths the first code block after the ``Layout`` heading names: folders (ending in ``/``) and files.

    A line is ``<indent><name>[, <name>...]  <description>``; a name is relative to the folders above
    it with less indentation. Continuation lines of a description name nothing.
    """
    block = re.split(r"^#+ Layout.*$", markdown, maxsplit=1, flags=re.M)[1].split("```", 2)[1]
    out: list[str] = []
    folders: list[tuple[int, str]] = []  # the folders enclosing the current line, by indentation
    for line in block.splitlines():
        m = re.match(r"^( *)(.+?)(?:\s{2,}|$)", line)
        if not m or not m.group(2).strip():
            continue
        indent, entry = len(m.group(1)), m.group(2).strip()
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = "".join(f for _, f in folders)
        if entry.endswith("/"):
            folders.append((indent, entry))
            out.append(parent + entry)
            continue
        out += [parent + name.strip() for name in entry.split(",")]
    return out


def test_docs_layout_names_every_module_and_no_other() -> None:
    named = {e for e in _layout_entries((REPO / "docs" / "layout.md").read_text()) if e.endswith(".py")}
    modules = set(_modules())
    missing = sorted(p for p in modules - named if not p.endswith("__init__.py"))
    assert not missing, f"docs/layout.md does not name: {missing}; fix: add a line for each"
    gone = sorted(p for p in named - modules if p.startswith(("pretrain/", "tiering/")))
    assert not gone, f"docs/layout.md names modules that are not in git: {gone}; fix: remove or rename them"


def test_readme_layout_lists_the_tracked_folders_and_subpackages() -> None:
    listed = set(_layout_entries((REPO / "README.md").read_text()))
    tracked = _tracked()
    folders = {p.split("/", 1)[0] + "/" for p in tracked if "/" in p}
    subpackages = {
        p.rsplit("/", 1)[0] + "/"
        for p in tracked
        if p.endswith("/__init__.py") and p.count("/") == 2 and p.startswith(("pretrain/", "tiering/"))
    }
    expected = folders | subpackages
    shown = {e for e in listed if e.endswith("/") and (e.count("/") == 1 or e.startswith(("pretrain/", "tiering/")))}
    assert not expected - shown, f"README layout does not list: {sorted(expected - shown)}; fix: add a line for each"
    assert not shown - expected, f"README layout lists what git does not track: {sorted(shown - expected)}"


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
    for path in (REPO / "tiering").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) pretrain\b", text, re.M), path


def test_tiering_top_level_holds_at_most_ten_modules() -> None:
    top = sorted(p.name for p in (REPO / "tiering").glob("*.py"))
    assert len(top) <= TIERING_TOP_LEVEL_MAX, (
        f"tiering/ has {len(top)} top-level modules (at most {TIERING_TOP_LEVEL_MAX}, __init__.py and "
        f"__main__.py included): {top}; fix: move a module into the subpackage of its concern"
    )


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"links to nothing: {broken}; fix: point them at an existing file"
