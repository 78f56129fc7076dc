"""The configuration reference (``docs/configuration.md``), generated from the config dataclasses.

It owns one thing: walking ``dataclasses.fields`` of :class:`pretrain.config.Config` recursively and
writing every YAML key with its type, its default and one line of meaning. The meaning is the
field's comment in the source (the comment lines right above the field, then a comment on its own
line), read with ``inspect``/``tokenize``, so the reference cannot drift from the code as long as
``tests/test_config_reference.py`` (which regenerates and compares) passes. It never loads a YAML
file, validates nothing and imports nothing but the config. Called as
``python -m pretrain.config_reference`` (writes the file; ``--check`` only compares).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pretrain.config import Config

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
COMMAND = "python -m pretrain.config_reference"

HEADER = f"""# Configuration reference

Every key of a run's YAML config (`configs/*.yaml`, `--set section.key=value`), its type, its
default and what it means. Generated from the dataclasses in `pretrain/config/` and their field
comments by `{COMMAND}`; `tests/test_config_reference.py` fails when this file
and the code differ. Unknown keys, wrong types and impossible combinations are refused before any
process starts, in one line naming the file, the key and the fix (README, "Configuration").
"""


def field_comments(cls: type) -> dict[str, str]:
    """``{field name: its comment as one line}`` for the fields of dataclass ``cls``.

    A field's comment is the block of ``#`` lines directly above it (no blank line between) and a
    ``#`` comment at the end of its own line, in that order.
    """
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()  # lines holding code (a comment there is a trailing one)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    lines = source.splitlines()
    out: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        name = _field_name(line)
        if name is None:
            continue
        above: list[str] = []
        prev = number - 1
        while prev in comments and prev not in code_lines:
            above.insert(0, comments[prev])
            prev -= 1
        trailing = [comments[number]] if number in comments else []
        out[name] = " ".join(above + trailing)
    return out


def _field_name(line: str) -> str | None:
    """The field a class-body line declares (``    name: type = ...``), or None."""
    if not line.startswith("    ") or line.startswith("     "):
        return None  # fields sit at the class body's indentation, one level deep
    head = line.strip().split(":", 1)[0]
    return head if head.isidentifier() and ":" in line and not line.strip().startswith("def ") else None


def render_type(tp: Any) -> str:
    """A YAML reader's name for a field's type: ``int | null``, ``"wait" | "skip"``, ``list of ...``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(render_type(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {render_type(typing.get_args(tp)[0])}"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"map {render_type(key)} -> {render_type(value)}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return tp.__name__


def render_default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return "(section)"
    return json.dumps(value)


def _yaml_key(name: str) -> str:
    return name.rstrip("_")  # Python keywords carry a trailing underscore (checkpoint.async_)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name} has no default")  # every key must be optional in YAML


def _code(text: str) -> str:
    """A table cell in code style (a pipe would end the cell)."""
    return "`" + text.replace("|", "\\|") + "`"


def _prose(text: str) -> str:
    """A table cell of prose: a pipe would end the cell, ``<...>`` would read as HTML."""
    return text.replace("|", "\\|").replace("<", "\\<")


def _section(cls: type, path: str, out: list[str]) -> None:
    """Append the table of ``cls``'s own keys at ``path``, then every nested section's."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    nested: list[tuple[type, str]] = []
    rows: list[str] = []
    for f in fields:
        tp = hints[f.name]
        key = f"{path}.{_yaml_key(f.name)}" if path else _yaml_key(f.name)
        if dataclasses.is_dataclass(tp):
            nested.append((tp, key))
            continue
        cells = (_code(key), _code(render_type(tp)), _code(render_default(_default(f))), _prose(comments[f.name]))
        rows.append("| " + " | ".join(cells) + " |")
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if item is not None and dataclasses.is_dataclass(item):
            nested.append((item, f"{key}[]"))
    if path:
        out += [f"## `{path}`", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(cls.__name__ + "("):  # dataclasses invent a signature docstring
            out += [" ".join(doc.split()), ""]
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for child, key in nested:
        _section(child, key, out)


def undocumented(cls: type = Config) -> list[str]:
    """Fields of ``cls`` and its sections without a comment (every key needs one line of meaning)."""
    missing: list[str] = []
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            missing += undocumented(tp)
        elif not f.metadata.get("internal") and not comments.get(f.name):
            missing.append(f"{cls.__name__}.{f.name}")
        if item is not None and dataclasses.is_dataclass(item):
            missing += undocumented(item)
    return missing


def reference() -> str:
    out = [HEADER]
    _section(Config, "", out)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when the file is stale")
    parser.add_argument("--output", type=Path, default=REFERENCE)
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output}: out of date with pretrain/config/; fix: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
