"""Recipe: one YAML file configures every stage. Strict: unknown keys and bad values name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.clients import ClientSpec
from rl.config import GiGPOConfig
from sft.train import SFTSection
from sandbox.scenes import scene_ids


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
    name: str
    seed: int = 0
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    judge: JudgeSection = Field(default_factory=JudgeSection)
    distill: DistillSection = Field(default_factory=DistillSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    rl: GiGPOConfig = Field(default_factory=GiGPOConfig)


class RecipeError(ValueError):
    """A recipe or task file is malformed; the message names the file and the field."""


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation(path, e)) from e


def format_validation(path, e: ValidationError) -> str:
    lines = []
    for err in e.errors()[:5]:
        field = ".".join(str(x) for x in err["loc"]) or "(top level)"
        lines.append(f"{path}: {field}: {err['msg']}")
    return "\n".join(lines)
