"""Trajectory / Turn: the one interchange format between stages (JSONL on disk, written atomically)."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class TurnState(BaseModel):
    """What the environment recorded after a turn: the agent's place and holdings, and the facts its belief
    gained this turn (`seen:ID`, `inspected:ID`, `locked:ID`, `told:FACT`, ...). Judges check temporal
    preconditions against this history instead of guessing from text."""

    model_config = ConfigDict(extra="forbid")

    place: str
    holding: list[str] = Field(default_factory=list)
    learned: list[str] = Field(default_factory=list)


class SubgoalInfo(BaseModel):
    """A subgoal as the judge sees it: id, description and predicate kind (observed, reported, ...)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    description: str
    kind: str


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    prompt: list[dict] = Field(default_factory=list)   # the messages the policy saw
    reasoning: str = ""
    tool_call: dict | None = None                      # {"name", "arguments"}; None if unparseable
    raw_output: str | None = None
    observation: str
    error: str | None = None
    trigger: str | None = None
    state_key: str
    subgoals_met: list[str] = Field(default_factory=list)
    human_reply: str | None = None
    state: TurnState | None = None

    @field_validator("tool_call")
    @classmethod
    def _call_shape(cls, v):
        if v is not None:
            if not isinstance(v.get("name"), str):
                raise ValueError(f"a tool call's name is a string, not {v.get('name')!r}")
            if not isinstance(v.get("arguments", {}), dict):
                raise ValueError(f"a tool call's arguments are an object, not {v.get('arguments')!r}")
        return v


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str
    instruction: str
    difficulty: str
    scene: str
    policy: str
    seed: int
    initial_observation: str
    initial_state_key: str
    turns: list[Turn] = Field(default_factory=list)
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    subgoals_total: int = Field(default=0, ge=0)
    subgoals: list[SubgoalInfo] = Field(default_factory=list)
    initial_subgoals_met: list[str] = Field(default_factory=list)   # already true in the initial state
    subgoals_met: int = Field(default=0, ge=0)    # at most the subgoal count (checked below)
    optimal_steps: int = Field(default=0, ge=0)
    final_answer: str | None = None

    @model_validator(mode="after")
    def _counts_in_range(self):
        total = self.subgoals_total or len(self.subgoals)
        if self.subgoals_met > total:
            raise ValueError(f"subgoals_met ({self.subgoals_met}) is more than the task's subgoals ({total})")
        return self


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_beside(path: Path, directory: bool = False) -> tuple[int | None, str]:
    """A temp file (or folder) next to `path` for an atomic replace, with the permissions an ordinary `open`
    (or `mkdir`) would give, not mkstemp's private 0600, so the renamed result is readable like any output."""
    if directory:
        tmp = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.chmod(tmp, 0o777 & ~_umask())
        return None, tmp
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_umask())
    return fd, tmp


@contextmanager
def atomic_target(path: str | Path) -> Iterator[str]:
    """A temp file path beside `path`: renamed onto `path` when the block succeeds, removed when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` whole or not at all."""
    with atomic_target(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


class DataFileError(ValueError):
    """A data file that cannot be read at all (missing, a corrupt or truncated gzip); names the file and where."""


def read_text(path: str | Path) -> str:
    """A whole text file (`.gz`: through gzip) as UTF-8, a BOM dropped; a bad byte or a broken gzip raises
    `DataFileError` naming the file and the line."""
    lines = []
    for i, text, err in numbered_lines(path):
        if err:
            raise DataFileError(f"{path}:{i}: {err}")
        lines.append(text)
    return "".join(lines)


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str | None, str | None]]:
    """Each line of a text file as (line number, text, None), or (line number, None, reason) for a line that
    is not UTF-8, so one bad byte costs one line, not the file. A UTF-8 BOM before line 1 is dropped. A `.gz`
    file is read through gzip; a truncated or corrupt one raises `DataFileError` after its last whole line."""
    import gzip
    import zlib
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{path}: no such file")
    i = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for i, raw in enumerate(f, 1):
                if i == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield i, None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                    continue
                yield i, text, None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataFileError(f"{path}: a corrupt or truncated gzip file, unreadable after line {i} "
                            f"({type(e).__name__}: {e})") from None


def write_jsonl(path: str | Path, rows: Iterable[BaseModel]) -> None:
    """Write JSONL atomically: a temp file in the same folder, then rename (gzip-compressed for a `.gz` name,
    with a zero mtime so the same rows give the same bytes)."""
    path = Path(path)
    with atomic_target(path) as tmp:
        if path.suffix == ".gz":
            import gzip
            import io
            # no name and a zero mtime in the header: the same rows give the same bytes
            with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz, \
                    io.TextIOWrapper(gz, encoding="utf-8") as f:
                for r in rows:
                    f.write(r.model_dump_json() + "\n")
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(r.model_dump_json() + "\n")


def read_jsonl(path: str | Path, model: type[BaseModel]) -> Iterator[BaseModel]:
    """Every row of a JSONL file (`.gz`: gzip); the first bad line raises ValueError naming the file and line."""
    for i, line, err in numbered_lines(path):
        if err:
            raise DataFileError(f"{path}:{i}: {err}")
        if line.strip():
            try:
                yield model.model_validate_json(line)
            except Exception as e:  # name the file and line
                raise ValueError(f"{path}:{i}: {e}") from e


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_jsonl_lenient(path: str | Path, model: type[BaseModel]) -> tuple[list[tuple[int, BaseModel]], list[dict]]:
    """Read every valid line; collect each bad one as {"line", "error"} naming the field, instead of stopping.
    Returns ([(line number, row)], [errors])."""
    from pydantic import ValidationError
    rows, errors = [], []
    for i, line, err in numbered_lines(path):
        if err:
            errors.append({"line": i, "error": err})
            continue
        if not line.strip():
            continue
        try:
            rows.append((i, model.model_validate_json(line)))
        except ValidationError as e:
            if e.errors()[0]["type"] == "json_invalid":
                errors.append({"line": i, "error": f"not JSON: {e.errors()[0]['msg'][:120]}"})
                continue
            parts = []
            for x in e.errors()[:3]:
                where = ".".join(str(p) for p in x["loc"]) or "(line)"
                parts.append(f"{where}: {x['msg']}")
            errors.append({"line": i, "error": "; ".join(parts)})
        except ValueError as e:
            errors.append({"line": i, "error": f"not JSON: {str(e)[:120]}"})
    return rows, errors
