"""TextWorld games made on this machine by `tw-make`, cached by what made them.

    from textworld_env.games import GameSpec, make_game
    path = make_game(GameSpec(kind="coin_collector", level=5, seed=3), "outputs/textworld/games")

A `GameSpec` is everything `tw-make` needs to build one game; the same spec always gives the same game (tw-make is
seeded), so a game is built once and found again under its spec's hash. A game is written whole or not at all:
tw-make writes into a temporary folder that is renamed into place, so an interrupted build leaves nothing that
looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KIND_COMMAND = {"simple": "tw-simple", "coin_collector": "tw-coin_collector",
                "treasure_hunter": "tw-treasure_hunter", "cooking": "tw-cooking", "custom": "custom"}
LEVELS = {"coin_collector": 300, "treasure_hunter": 30}


class GameSpec(BaseModel):
    """One game: its kind and that kind's settings, its goal text (tw-simple), and its seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["simple", "coin_collector", "treasure_hunter", "cooking", "custom"]
    seed: int = Field(ge=0)
    level: int | None = Field(default=None, ge=1)                   # coin_collector, treasure_hunter
    goal: Literal["detailed", "brief", "none"] = "detailed"          # simple
    rewards: Literal["dense", "balanced", "sparse"] = "dense"        # simple
    world_size: int | None = Field(default=None, ge=1, le=20)        # custom
    nb_objects: int | None = Field(default=None, ge=1, le=50)        # custom
    quest_length: int | None = Field(default=None, ge=1, le=20)      # custom
    recipe: int | None = Field(default=None, ge=1, le=5)             # cooking: ingredients in the recipe

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> "GameSpec":
        if self.kind in LEVELS:
            if self.level is None or self.level > LEVELS[self.kind]:
                raise ValueError(f"kind {self.kind!r} needs level between 1 and {LEVELS[self.kind]}, got {self.level}")
        elif self.level is not None:
            raise ValueError(f"level applies to coin_collector and treasure_hunter, not {self.kind!r}")
        custom = (self.world_size, self.nb_objects, self.quest_length)
        if self.kind == "custom" and None in custom:
            raise ValueError("kind 'custom' needs world_size, nb_objects and quest_length")
        if self.kind != "custom" and any(v is not None for v in custom):
            raise ValueError(f"world_size, nb_objects and quest_length apply to custom games, not {self.kind!r}")
        if self.recipe is not None and self.kind != "cooking":
            raise ValueError(f"recipe applies to cooking games, not {self.kind!r}")
        return self

    @property
    def key(self) -> str:
        """The spec's hash: the game's file name."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return f"{self.kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def command(self, output: Path) -> list[str]:
        """The `tw-make` command line that builds this game at `output`."""
        cmd = [_tw_make(), KIND_COMMAND[self.kind]]
        if self.kind == "simple":
            cmd += ["--goal", self.goal, "--rewards", self.rewards]
        elif self.kind in LEVELS:
            cmd += ["--level", str(self.level)]
        elif self.kind == "custom":
            cmd += ["--world-size", str(self.world_size), "--nb-objects", str(self.nb_objects),
                    "--quest-length", str(self.quest_length)]
        elif self.kind == "cooking":
            cmd += ["--recipe", str(self.recipe or 1), "--take", str(self.recipe or 1), "--go", "1"]
        return cmd + ["--seed", str(self.seed), "--output", str(output), "--format", "z8", "-f", "--silent"]


class GameBuildError(RuntimeError):
    """tw-make failed for a spec (its message and the command are in the error)."""


class NoQuestError(GameBuildError):
    """tw-make cannot make a quest of this spec with this seed (a property of the spec, not a failure: a split
    skips the seed)."""


def _tw_make() -> str:
    found = shutil.which("tw-make") or str(Path(sys.executable).with_name("tw-make"))
    if not Path(found).exists():
        raise GameBuildError("tw-make not found: install the TextWorld extra (`pip install -e '.[textworld]'`)")
    return found


def make_game(spec: GameSpec, folder: str | Path, timeout: float = 120.0) -> Path:
    """The `.z8` game of `spec` under `folder` (with its `.json` beside it), built now if not built before."""
    folder = Path(folder)
    final = folder / f"{spec.key}.z8"
    if final.is_file() and final.with_suffix(".json").is_file():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".{spec.key}-") as tmp:
        out = Path(tmp) / f"{spec.key}.z8"
        cmd = spec.command(out)
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env={**os.environ, "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            raise GameBuildError(f"{spec.key}: tw-make took over {timeout:.0f} s: {' '.join(cmd)}") from None
        if run.returncode != 0 or not out.is_file():
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            kind = NoQuestError if "QuestGenerationError" in (run.stderr or "") else GameBuildError
            raise kind(f"{spec.key}: tw-make failed (exit {run.returncode}): {' | '.join(tail)}; "
                                 f"command: {' '.join(cmd)}")
        (spec_file := Path(tmp) / f"{spec.key}.spec.json").write_text(spec.model_dump_json(indent=1))
        for part in (out.with_suffix(".json"), spec_file, out):   # the .z8 last: its presence means complete
            if part.is_file():
                os.replace(part, folder / part.name)
    return final
