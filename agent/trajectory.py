"""Trajectory / Turn: the one interchange format between stages (JSONL on disk, written atomically)."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field


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

    index: int
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
    subgoals_total: int = 0
    subgoals: list[SubgoalInfo] = Field(default_factory=list)
    initial_subgoals_met: list[str] = Field(default_factory=list)   # already true in the initial state
    subgoals_met: int = 0
    optimal_steps: int = 0
    final_answer: str | None = None


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


def open_text(path: str | Path):
    """Open a text file for reading; a `.gz` name is read through gzip (shipped data sets are compressed)."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


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
    with open_text(path) as f:
        for i, line in enumerate(f, 1):
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
    with open_text(path) as f:
        for i, line in enumerate(f, 1):
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
