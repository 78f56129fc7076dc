"""How a config error is raised: one line naming the file, the dotted key, the problem and the fix.

:class:`Fail` is scoped to a section's dotted path (``fail.within("async")``), so a nested section
names its keys in full without knowing where it sits. Every section check takes one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from pretrain.errors import ConfigError


@dataclass(frozen=True)
class Fail:
    """Raises the one-line :class:`ConfigError` for a key of one section.

    ``fail(key, problem, fix)`` names ``{path}.{key}``; ``within(name)`` scopes it to a child
    section; an empty key names the section itself.
    """

    source: str
    path: str = ""

    def __call__(self, key: str, problem: str, fix: str) -> NoReturn:
        full = ".".join(part for part in (self.path, key) if part)
        raise ConfigError(f"{self.source}: {full}: {problem}; fix: {fix}")

    def within(self, name: str) -> Fail:
        return Fail(self.source, f"{self.path}.{name}" if self.path else name)


def positive(fail: Fail, **values: int) -> None:
    for key, value in values.items():
        if value < 1:
            fail(key, f"must be >= 1, got {value}", "set a positive value")
