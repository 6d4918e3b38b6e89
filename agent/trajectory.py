"""Trajectory / Turn: the one interchange format between stages (JSONL on disk, written atomically)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field


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
    subgoals_met: int = 0
    optimal_steps: int = 0
    final_answer: str | None = None


def write_jsonl(path: str | Path, rows: Iterable[BaseModel]) -> None:
    """Write JSONL atomically: a temp file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            for r in rows:
                f.write(r.model_dump_json() + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_jsonl(path: str | Path, model: type[BaseModel]) -> Iterator[BaseModel]:
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield model.model_validate_json(line)
                except Exception as e:  # name the file and line
                    raise ValueError(f"{path}:{i}: {e}") from e


def write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
