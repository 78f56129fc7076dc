"""docs/configuration.md is the config's code written out: regenerated here and compared, every key
the loader accepts is in it, and every key has a line of meaning taken from its field comment."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pretrain.config import Config
from pretrain.config_reference import COMMAND, REFERENCE, field_comments, reference, undocumented


def test_the_configuration_reference_equals_the_code() -> None:
    assert REFERENCE.read_text() == reference(), (
        f"{REFERENCE.name} differs from pretrain/config/; fix: run `{COMMAND}` and commit docs/configuration.md"
    )


def test_every_config_key_has_a_line_of_meaning() -> None:
    assert undocumented() == [], "config fields without a comment; fix: add one above the field or at its line's end"


def _flat_keys(tree: dict[str, object], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value:  # a section (an empty dict is a map-valued key's default)
            out |= _flat_keys(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_the_reference_lists_every_key_the_loader_accepts_and_no_other() -> None:
    # Config.to_dict is what `pretrain train` writes as the resolved config: YAML key spelling.
    accepted = _flat_keys(Config().to_dict()) - {"source"}
    listed = set(re.findall(r"^\| `([a-z_.\[\]0-9]+)` \|", reference(), re.M))
    blend_items = {k for k in listed if "[]." in k}
    assert blend_items == {"data.blend[].prefix", "data.blend[].weight"}
    assert listed - blend_items == accepted


@dataclass
class _Sample:
    # Above a field,
    # over two lines.
    a: int = 1
    b: str = "x"  # at the line's end

    # After a blank line: still this field's.
    c: float = 0.5  # and at the end too
    d: bool = False


def test_a_fields_meaning_is_the_comment_above_it_then_the_one_at_its_end() -> None:
    assert field_comments(_Sample) == {
        "a": "Above a field, over two lines.",
        "b": "at the line's end",
        "c": "After a blank line: still this field's. and at the end too",
        "d": "",
    }
