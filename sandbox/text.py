"""Text helpers of the sandbox: the one normaliser (search queries, names, reports) and the report matcher."""

from __future__ import annotations

import re

_NON_WORD = re.compile(r"[^a-z0-9]+")
_NEGATIONS = {"not", "no", "isn", "isnt", "never", "un"}


def normalize(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space, trimmed: "Red  Mug!" -> "red mug"."""
    return " ".join(_NON_WORD.sub(" ", text.lower()).split())


def report_matches(answer: str, value: str, aliases: list[str], excludes: list[str] = ()) -> bool:
    """A short report that names the value (or an alias) as whole words, without negating it."""
    a = f" {normalize(answer)} "
    if len(a.split()) > 16:
        return False
    if any(f" {n} " in a for n in _NEGATIONS) or any(f" {normalize(x)} " in a for x in excludes if normalize(x)):
        return False
    return any(f" {normalize(v)} " in a for v in [value, *aliases] if normalize(v))
