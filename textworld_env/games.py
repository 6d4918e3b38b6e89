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
import random
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Literal

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


# ----------------------------------------------------------------------------- splits of games

SPLIT_INDEX = {"train": 0, "test": 1, "rl": 2}
_Range = int | Annotated[list[int], Field(min_length=2, max_length=2)]   # a number, or [lo, hi]


class GameFamily(BaseModel):
    """A kind of game a recipe draws from: a `GameSpec` without its seed, where a number may be a range
    `[lo, hi]` (inclusive) drawn per game. `name` labels the family in reports (default: the kind, and the goal
    text for tw-simple). Strict, as a recipe is: `"3"` is not a number."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["simple", "coin_collector", "treasure_hunter", "cooking", "custom"]
    name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9_-]{0,40}$")
    level: _Range | None = None
    goal: Literal["detailed", "brief", "none"] = "detailed"
    rewards: Literal["dense", "balanced", "sparse"] = "dense"
    world_size: _Range | None = None
    nb_objects: _Range | None = None
    quest_length: _Range | None = None
    recipe: int | None = Field(default=None, ge=1, le=5)

    @model_validator(mode="after")
    def _ranges_and_spec(self) -> "GameFamily":
        for field_name in ("level", "world_size", "nb_objects", "quest_length"):
            v = getattr(self, field_name)
            if isinstance(v, list) and v[0] > v[1]:
                raise ValueError(f"{field_name}: a range is [lo, hi] with lo <= hi, not {list(v)}")
        self.spec(0, random.Random(0))        # every value in range makes a valid spec: check the ends
        self.spec(0, _Ends(1))
        return self

    @property
    def label(self) -> str:
        return self.name or (f"simple-{self.goal}" if self.kind == "simple" else self.kind)

    def spec(self, seed: int, rng: random.Random) -> GameSpec:
        """One game of the family: each range drawn from `rng`, in field order."""
        def draw(v):
            return rng.randint(v[0], v[1]) if isinstance(v, list) else v
        values = {k: draw(getattr(self, k)) for k in ("level", "world_size", "nb_objects", "quest_length")}
        extra = {"goal": self.goal, "rewards": self.rewards} if self.kind == "simple" else {}
        return GameSpec(kind=self.kind, seed=seed, recipe=self.recipe, **values, **extra)


class _Ends(random.Random):
    """Draws the upper end of every range (to validate a family at both its ends)."""

    def randint(self, a: int, b: int) -> int:
        return b


class GameTask(BaseModel):
    """One game of a split, as the pipeline's stages handle a task: `TextWorldEnv.reset(options={"task": it})`.
    A game is its own instruction and layout (`instruction_id`, `layout_id`: the split's unit of holding out)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    game: str
    spec: GameSpec
    family: str                       # the family's label: what reports group by (as `difficulty`)

    @property
    def difficulty(self) -> str:
        return self.family

    @property
    def scene(self) -> str:
        return self.spec.kind

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def instruction_id(self) -> str:
        return self.id

    @property
    def layout_id(self) -> str:
        return self.id

    @property
    def fingerprint(self) -> list:
        """What a cached evaluation of this game depends on: its id, file and spec."""
        return [self.id, self.game, self.spec.key]


def split_seed(split: str, recipe_seed: int, family: int, i: int) -> int:
    """The tw-make seed of game `i` of family `family` in a split: splits, recipe seeds (< 100) and families
    (< 100) never share a seed."""
    if split not in SPLIT_INDEX:
        raise ValueError(f"split must be one of {', '.join(SPLIT_INDEX)}, not {split!r}")
    if not (0 <= recipe_seed < 100 and 0 <= family < 100 and 0 <= i < 10_000):
        raise ValueError("split_seed needs recipe_seed < 100, family < 100 and i < 10000")
    return SPLIT_INDEX[split] * 100_000_000 + recipe_seed * 1_000_000 + family * 10_000 + i


def build_games(families: list[GameFamily], split: str, per_family: int, folder: str | Path, recipe_seed: int = 0,
                progress=None, workers: int | None = None) -> list[GameTask]:
    """`per_family` games of each family for a split, built (or found in the cache) under `folder`, `workers`
    tw-make processes at a time (default: one per core). A seed that admits no quest is skipped for the next
    one (at most `3 * per_family + 10` seeds per family); which games a split holds depends on the seeds alone,
    never on the number of workers."""
    workers = workers or len(os.sched_getaffinity(0))
    tasks: list[GameTask] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for f, family in enumerate(families):
            made, i, limit = 0, 0, 3 * per_family + 10
            while made < per_family:
                if i >= limit:
                    raise GameBuildError(f"family {family.label}: only {made} of {per_family} {split} games after "
                                         f"{i} seeds (tw-make found no quest for the rest): widen its settings")
                # the next seeds, as many as are still needed (and workers allow), built side by side
                seeds = [split_seed(split, recipe_seed, f, j) for j in range(i, min(i + max(per_family - made, 1),
                                                                                     i + workers, limit))]
                i += len(seeds)
                specs = [family.spec(seed, random.Random(seed)) for seed in seeds]
                for spec, built in zip(specs, pool.map(_try_make, specs, [folder] * len(specs)), strict=True):
                    if built is None or made == per_family:      # no quest there, or enough made already
                        continue
                    tasks.append(GameTask(id=f"{split}-{family.label}-{made}-{spec.key.split('-')[-1][:8]}",
                                          game=str(built), spec=spec, family=family.label))
                    made += 1
                    if progress is not None:
                        progress(1)
    return tasks


def _try_make(spec: GameSpec, folder: str | Path) -> Path | None:
    """The game of `spec`, or None when its seed admits no quest."""
    try:
        return make_game(spec, folder)
    except NoQuestError:
        return None
