"""TextWorld games made on this machine, as `tw-make` makes them, cached by what made them.

    from textworld_env.games import GameSpec, make_game
    path = make_game(GameSpec(kind="coin_collector", level=5, seed=3), "outputs/textworld/games")

A `GameSpec` is everything `tw-make` needs to build one game; the same spec always gives the same game (TextWorld
is seeded), so a game is built once and found again under its spec's hash. A `Maker` builds games in one
long-lived process (`textworld_env/maker.py`), byte for byte the games `spec.command()` makes, without paying
TextWorld's start per game. A game is written whole or not at all: it is built in a temporary folder that is
renamed into place, so an interrupted build leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import random
import select
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

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

    def args(self) -> list[str]:
        """`tw-make`'s arguments for this game's kind and settings (no seed, no output)."""
        args = [KIND_COMMAND[self.kind]]
        if self.kind == "simple":
            args += ["--goal", self.goal, "--rewards", self.rewards]
        elif self.kind in LEVELS:
            args += ["--level", str(self.level)]
        elif self.kind == "custom":
            args += ["--world-size", str(self.world_size), "--nb-objects", str(self.nb_objects),
                     "--quest-length", str(self.quest_length)]
        elif self.kind == "cooking":
            args += ["--recipe", str(self.recipe or 1), "--take", str(self.recipe or 1), "--go", "1"]
        return args

    def command(self, output: Path) -> list[str]:
        """The `tw-make` command line that builds this game at `output` (what `Maker` builds, byte for byte)."""
        return ["tw-make", *self.args(), "--seed", str(self.seed), "--output", str(output), "--format", "z8",
                "-f", "--silent"]


class GameBuildError(RuntimeError):
    """tw-make failed for a spec (its message and the command are in the error)."""


class NoQuestError(GameBuildError):
    """tw-make cannot make a quest of this spec with this seed (a property of the spec, not a failure: a split
    skips the seed)."""


class BuildTimeout(GameBuildError):
    """A game took over the maker's time (`GAME_TIMEOUT_S`). A split skips the seed as one with no quest: the
    slow seeds are the ones TextWorld searches long for a quest and then finds none (treasure hunter level 20,
    seed 200030038: 3 min 52 s to a `QuestGenerationError`, where its other games take seconds)."""


GAME_TIMEOUT_S = 300.0


class Maker:
    """Builds games in one long-lived `textworld_env/maker.py` process (started on the first build, with
    `PYTHONHASHSEED=0` as tw-make ran). TextWorld's start (about 7 s) is paid once instead of once per game: after
    its first game, 2.5x fewer seconds per game than a `tw-make` process each (`benchmarks/textworld_games.py`).
    A build that takes over `timeout` seconds kills the process, and the next build starts a new one. Use it as a
    context manager, one per thread."""

    def __init__(self, timeout: float = GAME_TIMEOUT_S):
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._err = None

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            try:
                import textworld  # noqa: F401  (a clear error here rather than a dead child)
            except ImportError:
                raise GameBuildError("TextWorld is not installed: `pip install -e '.[textworld]'`") from None
            self._err = tempfile.TemporaryFile()
            self._proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("maker.py"))],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                          env={**os.environ, "PYTHONHASHSEED": "0"})
        return self._proc

    def _stderr_tail(self) -> str:
        if self._err is None:
            return ""
        self._err.seek(0)
        return " | ".join(self._err.read().decode(errors="replace").strip().splitlines()[-3:])

    def build(self, spec: GameSpec, output: Path) -> None:
        """Write the game of `spec` at `output` (a `.z8`, its `.json` beside it), or raise `NoQuestError` /
        `GameBuildError` naming the spec and the equivalent tw-make command."""
        proc = self._start()
        what = f"{spec.key} (as `{' '.join(spec.command(output))}`)"
        proc.stdin.write((json.dumps({"args": spec.args(), "seed": spec.seed, "output": str(output)}) + "\n").encode())
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
        if not ready:
            self.close()
            raise BuildTimeout(f"{what}: took over {self.timeout:.0f} s; the maker was stopped")
        line = proc.stdout.readline()
        if not line:
            tail = self._stderr_tail()
            self.close()
            raise GameBuildError(f"{what}: the maker process ended (exit {proc.poll()}): {tail}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise (NoQuestError if answer.get("no_quest") else GameBuildError)(f"{what}: {answer['error']}")

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None
        if self._err is not None:
            self._err.close()
            self._err = None

    def __enter__(self) -> "Maker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_game(spec: GameSpec, folder: str | Path, maker: Maker | None = None) -> Path:
    """The `.z8` game of `spec` under `folder` (with its `.json` beside it), built now if not built before (by
    `maker`, or a maker of its own for this one game)."""
    folder = Path(folder)
    final = folder / f"{spec.key}.z8"
    if final.is_file() and final.with_suffix(".json").is_file():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".{spec.key}-") as tmp:
        out = Path(tmp) / f"{spec.key}.z8"
        if maker is None:
            with Maker() as own:
                own.build(spec, out)
        else:
            maker.build(spec, out)
        if not out.is_file():
            raise GameBuildError(f"{spec.key}: the maker answered but wrote no game at {out}")
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
    """`per_family` games of each family for a split, built (or found in the cache) under `folder` by `workers`
    maker processes side by side (default: one per core). A seed that admits no quest, or whose build runs past
    `GAME_TIMEOUT_S` (`BuildTimeout`), is skipped for the next one and marked `KEY.skip` (at most
    `3 * per_family + 10` seeds per family); which games a split holds depends on the seeds alone, never on the
    number of workers."""
    workers = workers or len(os.sched_getaffinity(0))
    makers: queue.SimpleQueue[Maker] = queue.SimpleQueue()
    for _ in range(workers):
        makers.put(Maker())

    def try_make(spec: GameSpec) -> Path | None:
        maker = makers.get()                 # a maker of its own for this game
        try:
            return _try_make(spec, folder, maker)
        finally:
            makers.put(maker)

    tasks: list[GameTask] = []
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for f, family in enumerate(families):
                made, i, limit = 0, 0, 3 * per_family + 10
                while made < per_family:
                    if i >= limit:
                        raise GameBuildError(f"family {family.label}: only {made} of {per_family} {split} games "
                                             f"after {i} seeds (TextWorld found no quest for the rest): widen its "
                                             "settings")
                    # the next seeds, as many as are still needed (and workers allow), built side by side
                    seeds = [split_seed(split, recipe_seed, f, j)
                             for j in range(i, min(i + max(per_family - made, 1), i + workers, limit))]
                    i += len(seeds)
                    specs = [family.spec(seed, random.Random(seed)) for seed in seeds]
                    for spec, built in zip(specs, pool.map(try_make, specs), strict=True):
                        if built is None or made == per_family:      # no quest there, or enough made already
                            continue
                        tasks.append(GameTask(id=f"{split}-{family.label}-{made}-{spec.key.split('-')[-1][:8]}",
                                              game=str(built), spec=spec, family=family.label))
                        made += 1
                        if progress is not None:
                            progress(1)
    finally:
        while not makers.empty():
            makers.get().close()
    return tasks


def _try_make(spec: GameSpec, folder: str | Path, maker: Maker) -> Path | None:
    """The game of `spec`, or None when its seed admits no quest or its build runs past the maker's time. A
    skipped seed is marked `KEY.skip` under `folder` (with why), so that later builds skip it at once."""
    skip = Path(folder) / f"{spec.key}.skip"
    if skip.is_file():
        return None
    try:
        return make_game(spec, folder, maker)
    except (NoQuestError, BuildTimeout) as e:
        tmp = skip.with_name(f".{skip.name}.tmp")
        tmp.write_text(f"{e}\n")
        os.replace(tmp, skip)
        if isinstance(e, BuildTimeout):
            log.warning("skipped: %s", e)
        return None
