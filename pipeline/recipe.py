"""Recipe: one YAML file configures every stage. Strict: unknown keys, ill-typed values (`"2"` for a number,
`true` for a count) and duplicate keys are errors that name the file, the line and the field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.clients import ClientSpec
from distill.onpolicy import OnPolicyConfig
from rl.config import GiGPOConfig
from sft.train import SFTSection
from sandbox.scenes import scene_ids
from textworld_env.games import GameFamily


_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def safe_name(v: str, what: str) -> str:
    """`v` if it can name one file or folder inside an output folder, never outside it: letters, digits, '.',
    '_' and '-', starting with a letter or digit, at most 64 characters. Else a ValueError saying so."""
    if not _SAFE_NAME.fullmatch(v):
        raise ValueError(f"{what} may use letters, digits, '.', '_' and '-' (starting with a letter or digit, "
                         f"at most 64), not {v!r}")
    return v


class RecipeError(ValueError):
    """A recipe or task file is malformed; the message names the file, the line and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SandboxSection(_Strict):
    scenes: list[str] | Literal["all"] = "all"
    train_instructions_per_scene: int = Field(default=4, ge=1, le=10_000)
    test_instructions_per_scene: int = Field(default=2, ge=1, le=10_000)
    difficulties: list[Literal["easy", "medium", "hard"]] = Field(default_factory=lambda: ["easy", "medium", "hard"])
    budget_factor: float = Field(default=3.0, ge=1.0, le=20.0)
    budget_slack: int = Field(default=16, ge=0, le=200)
    max_budget: int = Field(default=150, ge=5, le=500)
    max_attempts: int = Field(default=10, ge=1, le=100)
    # who writes the task variants: the procedural builder, or a model (same validation, bounded retries)
    builder: Literal["procedural", "llm"] = "procedural"
    builder_model: ClientSpec | None = None
    builder_attempts: int = Field(default=3, ge=1, le=20)
    # how people word their replies: the rule persona, or a model (the rules still decide what happens)
    persona: Literal["rule", "llm"] = "rule"
    persona_model: ClientSpec | None = None
    # "colour type" targets that no train instruction may have ("purple ball"): the test tasks that target them
    # form the compositional split (both words known from training, the combination never targeted)
    compositional_holdout: list[str] = Field(default_factory=list)

    @field_validator("compositional_holdout")
    @classmethod
    def _combos(cls, v):
        bad = [x for x in v if len(x.split()) < 2]
        if bad:
            raise ValueError(f"entries are 'colour type' (e.g. 'purple ball'), not {bad}")
        return v

    def holdout_combos(self) -> set[tuple[str, str]]:
        """{(type, colour)} of `compositional_holdout` ("purple ball" -> ("ball", "purple"))."""
        return {(" ".join(x.split()[1:]), x.split()[0]) for x in self.compositional_holdout}

    @model_validator(mode="after")
    def _models(self):
        if self.builder == "llm" and self.builder_model is None:
            raise ValueError("builder: llm needs builder_model (kind, model, base_url, ...)")
        if self.persona == "llm" and self.persona_model is None:
            raise ValueError("persona: llm needs persona_model (kind, model, base_url, ...)")
        return self

    @field_validator("scenes")
    @classmethod
    def _known(cls, v):
        if v == "all":
            return v
        known = set(scene_ids())
        bad = [s for s in v if s not in known]
        if bad:
            raise ValueError(f"unknown scene(s) {bad}; known: {sorted(known)}")
        if not v:
            raise ValueError("at least one scene")
        return v

    def scene_list(self) -> list[str]:
        return scene_ids() if self.scenes == "all" else list(self.scenes)


class TextWorldSection(_Strict):
    """TextWorld games for `env: textworld`: the families to draw from and how many games of each per split.
    Splits never share a game (their tw-make seeds are disjoint: `textworld_env.games.split_seed`); games are
    built once and cached under `folder` by their spec."""

    games: list[GameFamily] = Field(min_length=1)
    # the games' own seed (0-99): the recipe's `seed` seeds training, so 3 training seeds play the same games
    seed: int = Field(default=0, ge=0, lt=100)
    train_games_per_family: int = Field(default=20, ge=1, le=10_000)
    test_games_per_family: int = Field(default=20, ge=1, le=10_000)
    pool_games_per_family: int = Field(default=10, ge=1, le=10_000)   # the RL pool and on-policy rounds
    folder: str = "outputs/textworld/games"


class EvalSection(_Strict):
    seed: int = 0
    # a model folder's decoding can only write well-formed compact calls over ids its prompt shows
    # (`agent.constrained`; a tiny student's tokenizer): `embodistill eval` and the learning benchmark
    constrained: bool = False


class JudgeSection(_Strict):
    """The reward engine: the rule-program backend (offline default) or an LLM judge through a client."""

    backend: Literal["rule", "llm"] = "rule"
    model: ClientSpec | None = None
    prompt: str | None = None          # a reward-prompt snapshot JSON; default: the embedded v1
    max_repairs: int = Field(default=2, ge=0, le=10)

    @model_validator(mode="after")
    def _model(self):
        if self.backend == "llm" and self.model is None:
            raise ValueError("backend: llm needs model (kind, model, base_url, ...)")
        return self


class DistillSection(_Strict):
    """Teacher rollouts on the train split, the judge filter, and the SFT dataset (`distill/`)."""

    # "expert": the embedded scripted teacher (belief only); or any chat model through a client spec
    teacher: Literal["expert"] | ClientSpec = "expert"
    concurrency: int = Field(default=8, ge=1, le=1024)          # episodes at once (API teachers only)
    tasks_per_difficulty: int | None = Field(default=None, ge=1)  # the first N train tasks per difficulty
    # the filter: a trajectory is kept iff it succeeded, the judge had no error, and all of these hold
    min_episode_score: float = Field(default=0.6, ge=0.0, le=1.0)
    max_bad_turn_share: float = Field(default=0.1, ge=0.0, le=1.0)   # turns labelled inconsistent/unsafe/malformed
    max_loop_share: float = Field(default=0.25, ge=0.0, le=1.0)      # turns labelled redundant (loops, repeats)
    validation_fraction: float = Field(default=0.05, gt=0.0, lt=1.0)  # of instructions (whole instructions)
    sample_format: Literal["step", "conversation"] = "step"  # the config SFT trains on (both are written)
    license: str = Field(default="apache-2.0", pattern=r"^[a-z0-9][a-z0-9.\-]*$")
    pretty_name: str | None = None   # the dataset card's title (default: "embodistill <recipe name>")


class Recipe(_Strict):
    name: str   # a folder under outputs/ (`safe_name`)
    seed: int = 0
    # where the tasks come from: the project's sandbox, or TextWorld games (its `textworld:` section)
    env: Literal["sandbox", "textworld"] = "sandbox"
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    textworld: TextWorldSection | None = None
    eval: EvalSection = Field(default_factory=EvalSection)
    judge: JudgeSection = Field(default_factory=JudgeSection)
    distill: DistillSection = Field(default_factory=DistillSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    onpolicy: OnPolicyConfig = Field(default_factory=OnPolicyConfig)
    rl: GiGPOConfig = Field(default_factory=GiGPOConfig)

    @field_validator("name")
    @classmethod
    def _folder_name(cls, v):
        return safe_name(v, "the recipe name (a folder under outputs/)")

    @model_validator(mode="after")
    def _env_section(self):
        if self.env == "textworld" and self.textworld is None:
            raise ValueError("env: textworld needs a textworld: section (games: [{kind: ..., ...}], ...)")
        if self.env == "sandbox" and self.textworld is not None:
            raise ValueError("a textworld: section needs env: textworld")
        return self


class _RecipeYAML(yaml.SafeLoader):
    """PyYAML's safe loader, stricter: a duplicate key is an error (PyYAML keeps the last one silently), and
    `1e-3` is a number as in YAML 1.2 (PyYAML follows YAML 1.1, where a float needs a dot: `1e-3` is a string)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_RecipeYAML.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                                                                      r"[eE][-+]?[0-9]+$"), list("-+0123456789."))


def read_yaml_text(path: Path, what: str = "file") -> str:
    """A YAML file's text, decoded as UTF-8 (a BOM is dropped); a bad byte names its line and column."""
    if path.is_dir():
        raise RecipeError(f"{path}: is a directory, not a {what}")
    if not path.is_file():
        raise RecipeError(f"{path}: no such {what}")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise RecipeError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {col})") from None


def load_client_spec(path: str | Path) -> ClientSpec:
    """A model client spec from a YAML (or JSON) file, as strict as a recipe's (`kind`, `model`, `base_url`,
    ...); a problem raises `RecipeError` naming the file, the line and the field."""
    return _load(Path(path), ClientSpec, "client spec")


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe; any problem raises `RecipeError` with `FILE:LINE: field: reason`."""
    return _load(Path(path), Recipe, "recipe")


def _load(path: Path, model: type[BaseModel], what: str):
    """`model` validated from the YAML mapping in `path`, or `RecipeError` naming the file, line and field."""
    text = read_yaml_text(path, f"{what} file")
    try:
        loader = _RecipeYAML(text)
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as e:
        where = f":{e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise RecipeError(f"{path}{where}: not a valid {what}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a {what} must be a YAML mapping")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation(path, e, root)) from None


def _line(node, loc) -> int | None:
    """The 1-based line of the YAML node at `loc` (a pydantic error location), or of its nearest parent."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            break   # a union member's name or a model-level error: the parent's line
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def _member(part) -> bool:
    """Whether a pydantic error location part names a member of a union (`ClientSpec`, `literal['expert']`,
    `bool`, `list[str]`), not a field: such parts are left out of the field name a user reads."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("bool", "str", "int", "float"))


def format_validation(path, e: ValidationError, root=None) -> str:
    """One line per field (at most 5): `FILE[:LINE]: field: reason`. The reasons of a union's members join on one
    line; a member's type mismatch is left out when another member got further (`teacher: {kind: openai,
    timeout: "5"}` is about the timeout, not about not being "expert")."""
    errors = e.errors()
    deep = {tuple(p for p in err["loc"] if not _member(p)) for err in errors}
    fields: dict[tuple, list[str]] = {}
    for err in errors:
        loc = tuple(p for p in err["loc"] if not _member(p))
        if len(loc) < len(err["loc"]) and any(len(d) > len(loc) and d[:len(loc)] == loc for d in deep):
            continue
        if err["msg"] not in fields.setdefault(loc, []):
            fields[loc].append(err["msg"])
    lines = []
    for loc, msgs in list(fields.items())[:5]:
        field = ".".join(str(x) for x in loc) or "(top level)"
        line = _line(root, loc) if root is not None else None
        lines.append(f"{path}{f':{line}' if line else ''}: {field}: {'; or '.join(msgs)}")
    return "\n".join(lines)
