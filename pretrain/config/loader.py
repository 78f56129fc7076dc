"""YAML -> :class:`~pretrain.config.root.Config`: unknown keys (with a "did you mean"), wrong types
and ``--set key=value`` overrides, each a one-line :class:`~pretrain.errors.ConfigError`. No rule of
any section lives here."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from pretrain.config.root import Config
from pretrain.errors import ConfigError


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load ``path`` (YAML) and apply ``key.sub=value`` overrides; raise ConfigError on any issue."""
    source = str(path) if path is not None else "<defaults>"
    data: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"{source}: cannot read config ({exc.strerror}); fix: pass an existing YAML file"
            ) from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{source}:{where}: not valid YAML; fix: correct the syntax") from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}: top level must be a mapping of sections; fix: start with 'run:', 'model:', ..."
            )
    for item in overrides:
        _apply_override(data, item, source)
    cfg = _build(Config, data, "", source)
    cfg.source = source
    return cfg


def _apply_override(data: dict[str, Any], item: str, source: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE; fix: e.g. --set train.steps=200")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: --set {key}: '{part}' is not a section; fix: override a leaf key")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "<top>"
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: {where}: expected a mapping, got {type(data).__name__}; fix: write it as 'key: value' lines"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    # Python keywords are spelled with a trailing underscore in the dataclass (checkpoint.async).
    data = {(f"{k}_" if f"{k}_" in fields and k not in fields else k): v for k, v in data.items()}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; fix: remove it ({hint})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}", source)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key + ".", source)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        words = next((a for a in args if typing.get_origin(a) is Literal), None)
        if words is None:
            return _coerce(args[0], value, key, source)
        # A number or a word (e.g. float | Literal["auto"]): a string is one of the words.
        other = next(a for a in args if a is not words)
        if isinstance(value, str) and value not in typing.get_args(words):
            choices = ", ".join(map(str, typing.get_args(words)))
            raise ConfigError(f"{source}: {key}={value!r} is not allowed; fix: give a {other.__name__} or {choices}")
        return _coerce(words if isinstance(value, str) else other, value, key, source)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in choices:
            raise ConfigError(
                f"{source}: {key}={value!r} is not allowed; fix: use one of {', '.join(map(str, choices))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list; fix: write '- item' entries (or [a, b] inline)")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping; fix: write 'key: value' entries")
        return {str(k): str(v) for k, v in value.items()}
    return _coerce_scalar(tp, value, key, source)


# The YAML types each scalar field accepts (a bool is never a number: YAML's true is not 1).
_SCALARS: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _coerce_scalar(tp: Any, value: Any, key: str, source: str) -> Any:
    if tp not in _SCALARS:  # pragma: no cover - a field type this loader does not know is a programming error
        raise TypeError(f"unsupported config field type {tp!r} for {key}")
    if isinstance(value, _SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
        return float(value) if tp is float else value
    raise ConfigError(
        f"{source}: {key}={value!r} has type {type(value).__name__}, expected {tp.__name__}; fix: give a {tp.__name__}"
    )
