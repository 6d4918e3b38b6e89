"""The dataset card: YAML metadata from a validated pydantic model, then prose on how the data was made.

`card_metadata` builds the metadata (license, task categories, tags, language, size category, configs with
their data files per split, dataset_info with features and example counts per split), `render_card` writes
README.md, and `validate_artifact` checks a folder offline: the YAML parses as Hub card data
(`huggingface_hub.DatasetCard`) and round-trips, matches this model (unknown keys are errors), reads back
through `datasets`' own config and info parsers with the features the code writes, and every split's shard
exists with the row count the card claims. Nothing private (keys, endpoints) is ever written.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distill.dataset import ALL_CONFIGS, ONPOLICY, SPLITS, data_path, features

SIZE_CATEGORIES = ("n<1K", "1K<n<10K", "10K<n<100K", "100K<n<1M", "1M<n<10M", "10M<n<100M", "100M<n<1B")
TASK_CATEGORIES = ("text-generation", "reinforcement-learning", "robotics", "question-answering",
                   "text2text-generation")
# License identifiers the Hub accepts (https://huggingface.co/docs/hub/repositories-licenses)
HUB_LICENSES = frozenset("""
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0 bigcode-openrail-m
afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0
cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0
cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0
cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 eupl-1.2 agpl-3.0 gfdl
gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc h-research intel-research lppl-1.3c ms-pl apple-ascl apple-amlr
mpl-2.0 odc-by odbl openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr
deepfloyd-if-license fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2 llama3.3 llama4 gemma
unknown other""".split())
BASE_TAGS = ("embodied-ai", "tool-calling", "function-calling", "agents", "distillation", "sft", "trl",
             "synthetic", "embodistill")


class CardError(ValueError):
    """A dataset card or artifact is invalid; the message names the file and the field."""


def check_license(value: str) -> str:
    if value not in HUB_LICENSES:
        raise ValueError(f"{value!r} is not a Hugging Face Hub license id (e.g. apache-2.0, mit, cc-by-4.0, other; "
                         "see https://huggingface.co/docs/hub/repositories-licenses)")
    return value


def size_category(n: int) -> str:
    for i, cat in enumerate(SIZE_CATEGORIES):
        if n < 1000 * 10 ** i:
            return cat
    raise ValueError(f"{n} examples is past the largest size category this card knows")


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataFiles(_M):
    split: Literal["train", "validation"]
    path: str = Field(min_length=1)


class ConfigEntry(_M):
    config_name: Literal["conversation", "step", "onpolicy"]
    data_files: list[DataFiles] = Field(min_length=1)
    default: bool | None = None


class SplitEntry(_M):
    name: Literal["train", "validation"]
    num_bytes: int = Field(ge=0)
    num_examples: int = Field(ge=0)   # the `onpolicy` config's validation split may be empty after one round


class DatasetInfoEntry(_M):
    config_name: Literal["conversation", "step", "onpolicy"]
    features: list[dict]
    splits: list[SplitEntry] = Field(min_length=1)
    download_size: int = Field(ge=0)
    dataset_size: int = Field(ge=0)


class CardMetadata(_M):
    """The card's YAML front matter."""

    license: str
    language: list[Literal["en"]] = ["en"]
    pretty_name: str = Field(min_length=1, max_length=120)
    task_categories: list[Literal[TASK_CATEGORIES]] = Field(min_length=1)   # type: ignore[valid-type]
    tags: list[str] = Field(min_length=1)
    size_categories: list[Literal[SIZE_CATEGORIES]] = Field(min_length=1, max_length=1)  # type: ignore[valid-type]
    annotations_creators: list[Literal["machine-generated"]] = ["machine-generated"]
    language_creators: list[Literal["machine-generated"]] = ["machine-generated"]
    multilinguality: list[Literal["monolingual"]] = ["monolingual"]
    source_datasets: list[Literal["original"]] = ["original"]
    configs: list[ConfigEntry] = Field(min_length=1)
    dataset_info: list[DatasetInfoEntry] = Field(min_length=1)

    @field_validator("license")
    @classmethod
    def _license(cls, v: str) -> str:
        return check_license(v)

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if not t or t != t.strip().lower() or " " in t]
        if bad:
            raise ValueError(f"tags must be lowercase words joined by '-', not {bad}")
        if len(set(v)) != len(v):
            raise ValueError("tags repeat")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "CardMetadata":
        names = [c.config_name for c in self.configs]
        infos = {i.config_name: i for i in self.dataset_info}
        if len(set(names)) != len(names) or len(infos) != len(self.dataset_info):
            raise ValueError("configs and dataset_info must name each config once")
        if set(names) != set(infos):
            raise ValueError(f"configs {sorted(names)} and dataset_info {sorted(infos)} name different configs")
        if sum(bool(c.default) for c in self.configs) > 1:
            raise ValueError("more than one config is marked default")
        for c in self.configs:
            files = [d.split for d in c.data_files]
            info = [s.name for s in infos[c.config_name].splits]
            if sorted(files) != sorted(info) or len(set(files)) != len(files):
                raise ValueError(f"config {c.config_name}: data_files splits {files} and dataset_info splits {info} "
                                 "differ")
        biggest = max(sum(s.num_examples for s in i.splits) for i in self.dataset_info)
        if self.size_categories != [size_category(biggest)]:
            raise ValueError(f"size_categories {self.size_categories} does not match the largest config's "
                             f"{biggest} examples ({size_category(biggest)})")
        return self

    def card_data(self):
        from huggingface_hub import DatasetCardData
        return DatasetCardData(**self.model_dump(mode="json", exclude_none=True))


def card_metadata(sizes: dict[str, dict[str, dict]], license: str, pretty_name: str, default_config: str,
                  file_sizes: dict[str, int] | None = None, extra_tags: tuple[str, ...] = ()) -> CardMetadata:
    """The metadata for an artifact whose splits have `sizes` ({config: {split: {num_examples, num_bytes}}})."""
    from datasets import DatasetInfo
    configs, infos = [], []
    names = [c for c in ALL_CONFIGS if c in sizes]
    for c in names:
        configs.append(ConfigEntry(config_name=c, default=True if c == default_config else None,
                                   data_files=[DataFiles(split=s, path=f"{c}/{s}-*") for s in SPLITS]))
        feats = DatasetInfo(features=features(c))._to_yaml_dict()["features"]
        splits = [SplitEntry(name=s, **sizes[c][s]) for s in SPLITS]
        infos.append(DatasetInfoEntry(config_name=c, features=feats, splits=splits,
                                      download_size=sum((file_sizes or {}).get(data_path(c, s), 0) for s in SPLITS),
                                      dataset_size=sum(s.num_bytes for s in splits)))
    biggest = max(sum(v["num_examples"] for v in sizes[c].values()) for c in names)
    tags = list(dict.fromkeys((*BASE_TAGS, *extra_tags)))
    return CardMetadata(license=license, pretty_name=pretty_name, task_categories=["text-generation"], tags=tags,
                        size_categories=[size_category(biggest)], configs=configs, dataset_info=infos)


# ----------------------------------------------------------------------------- prose


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def render_card(meta: CardMetadata, about: dict) -> str:
    """README.md: the YAML block, then how the data was made. `about` holds the run's facts: recipe, seed,
    teacher, judge, filter statistics, teacher metrics, difficulty mix, scenes, kinds, instructions."""
    f = about["filter"]
    sizes = {i.config_name: {s.name: s.num_examples for s in i.splits} for i in meta.dataset_info}
    default = next(c.config_name for c in meta.configs if c.default)
    judge = about["judge"]
    teacher = about["teacher"]
    parts = [
        f"# {meta.pretty_name}", "",
        "Multi-turn tool-calling trajectories of an embodied agent in the embodistill text sandbox (places, doors, "
        "objects, devices and people with personas; failure triggers such as locked doors, blocked paths, moved "
        "objects, broken devices, restricted areas and busy helpers), for distilling small agents with SFT. "
        "Trajectories keep the reasoning, every tool call, the observations (human replies included) and the "
        "final answer; failed attempts, help requests and recoveries are part of the samples.", "",
        "## Configs", "",
        _table(["config", "train", "validation", "one row is"],
               [["`conversation`", sizes["conversation"]["train"], sizes["conversation"]["validation"],
                 "a whole episode: system, the first step prompt, then assistant `tool_calls` / `tool` results"],
                ["`step`", sizes["step"]["train"], sizes["step"]["validation"],
                 "one decision: the step prompt RL rollouts show the student (task, known map, recent steps, "
                 "observation) and the assistant's call"]] +
               ([[f"`{ONPOLICY}`", sizes[ONPOLICY]["train"], sizes[ONPOLICY]["validation"],
                  "a state the student reached on its own (its step prompt), labelled with the teacher's call "
                  "there"]] if ONPOLICY in sizes else [])), "",
        *(_onpolicy_section(about["onpolicy"]) if ONPOLICY in sizes else []),
        f"The default config is `{default}` (the recipe's `distill.sample_format`). Both use the Hugging Face "
        "conversational format: `messages` (`role`, `content`, `tool_calls` with `function.name` and "
        "`function.arguments`, `tool_call_id`, `name`) and `tools` (the skills as JSON-schema function "
        "definitions). Columns `task_id`, `instruction_id`, `difficulty`, `scene`, `kind`, `teacher` and "
        "`episode_score` (and `step` in `step`) say where each sample comes from. Whole instructions go to train "
        f"or validation ({len(about['instructions']['train'])} and {len(about['instructions']['validation'])} "
        "instructions).", "",
        "## How it was made", "",
        f"- Recipe `{about['recipe']}` (seed {about['seed']}), embodistill {about['version']}: "
        f"{about['tasks']} train task instances, each instruction at up to three difficulties (easy: no "
        "obstacle; medium: one recoverable obstacle; hard: two or more, nested).",
        f"- Teacher: `{teacher}`" + (" (the embedded scripted expert acting on the agent's belief only: it "
                                     "searches or asks when it does not know, tries, fails and recovers)"
                                     if teacher == "expert" else " (a chat model through an OpenAI-compatible or "
                                                                 "local client)") +
        ", prompted with the shared step-prompt builder and the skill tool definitions; the sandbox executes "
        "every call.",
        f"- Judge: backend `{judge['backend']}`, reward prompt `{judge['prompt_name']}` v{judge['prompt_version']} "
        f"(content hash `{judge['prompt_hash']}`). It labels every turn (useful, redundant, unsafe, malformed, "
        "inconsistent) and scores the episode on completeness, report correctness, efficiency against the "
        "oracle's optimal steps and consistency.",
        f"- Filter: kept iff the episode succeeded, the judge had no error, episode score >= "
        f"{f['thresholds']['min_episode_score']}, share of inconsistent/unsafe/malformed turns <= "
        f"{f['thresholds']['max_bad_turn_share']}, share of redundant turns <= {f['thresholds']['max_loop_share']}.",
        "", "### Filter statistics", "",
        _table(["difficulty", "episodes", "kept", "rejected", "teacher success rate"],
               [[d, f["by_difficulty"][d]["episodes"], f["by_difficulty"][d]["kept"], f["by_difficulty"][d]["rejected"],
                 about["teacher_tsr"].get(d, "-")] for d in ("easy", "medium", "hard")] +
               [["all", f["episodes"], f["kept"], f["rejected"], about["teacher_tsr"].get("all", "-")]]), "",
        "Rejected, by first failing reason: " +
        (", ".join(f"{k} {v}" for k, v in f["rejected_reasons"].items() if v) or "none") +
        f". Mean episode score of the kept trajectories: {f['kept_mean_episode_score']}. Turn labels: " +
        ", ".join(f"{k} {v}" for k, v in f["turn_labels"].items()) + ".", "",
        "Judge findings per criterion (turns with a violation / trajectories affected): " +
        ", ".join(f"{k} {v['turns']}/{v['trajectories']}" for k, v in f["criteria"].items()) + ".", "",
        "### Mix of the kept trajectories", "",
        "- Difficulties: " + ", ".join(f"{k} {v}" for k, v in about["difficulty_mix"].items()),
        "- Scenes: " + ", ".join(f"{k} {v}" for k, v in about["scenes"].items()),
        "- Instruction kinds: " + ", ".join(f"{k} {v}" for k, v in about["kinds"].items()), "",
        "## Use", "",
        "```python",
        "from datasets import load_dataset",
        f'ds = load_dataset("REPO_OR_FOLDER", "{default}")   # splits: train, validation',
        "",
        "from trl import SFTConfig, SFTTrainer   # takes `messages` + `tools` as is",
        "trainer = SFTTrainer(model=\"Qwen/Qwen2.5-0.5B-Instruct\", train_dataset=ds[\"train\"],",
        "                     eval_dataset=ds[\"validation\"], args=SFTConfig(assistant_only_loss=True))",
        "trainer.train()",
        "```", "",
        "Or with the pipeline: `embodistill distill RECIPE` writes this folder; the recipe's `sft:` section trains "
        "on it.", "",
        f"## License\n\n{meta.license}", ""]
    return "---\n" + meta.card_data().to_yaml() + "\n---\n\n" + "\n".join(parts)


def _onpolicy_section(op: dict) -> list[str]:
    """The card's account of on-policy distillation: how the `onpolicy` rows were made, round by round."""
    return [
        "## The `onpolicy` config", "",
        f"On-policy distillation (DAgger): in each round the student of the previous round (round 1: the SFT "
        f"student) played {op['tasks']} tasks through the same step prompts, and the teacher (`{op['teacher']}`) "
        "labelled every state the student reached with its own thought and call from that state. Columns as "
        "`step`, plus `round`, `student_action` (what the student wrote there) and `agreed` (whether its call "
        "was the teacher's: same skill and arguments).", "",
        _table(["round", "beta", "rows", "agreement", "student success on its tasks"],
               [[r["round"], r["beta"], r["rows"], r["agreement"], r["student_tsr"]] for r in op["rounds"]]), ""]


# ----------------------------------------------------------------------------- validation


def _errors(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(metadata)'}: {err['msg']}" for err in e.errors()[:5])


def validate_artifact(folder: str | Path) -> CardMetadata:
    """Check a dataset folder offline (card metadata, datasets' parsers, shards and row counts)."""
    import pyarrow.parquet as pq
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    folder = Path(folder)
    readme = folder / "README.md"
    if not readme.is_file():
        raise CardError(f"{folder}: no README.md (dataset card); is this a folder written by `embodistill distill`?")
    text = readme.read_text()
    try:
        card = DatasetCard(text)
    except (ValueError, yaml.YAMLError) as e:
        raise CardError(f"{readme}: the YAML metadata does not parse: {e}") from e
    data = card.data.to_dict()
    if not data:
        raise CardError(f"{readme}: no YAML metadata block")
    try:
        meta = CardMetadata.model_validate(data)
    except ValidationError as e:
        raise CardError(f"{readme}: {_errors(e)}") from e
    if DatasetCardData(**meta.model_dump(mode="json", exclude_none=True)).to_dict() != data:
        raise CardError(f"{readme}: the metadata does not round-trip through huggingface_hub.DatasetCardData")
    try:
        configs = MetadataConfigs.from_dataset_card_data(card.data)
        infos = DatasetInfosDict.from_dataset_card_data(card.data)
    except (ValueError, KeyError, TypeError) as e:
        raise CardError(f"{readme}: datasets cannot read the configs/dataset_info: {e}") from e
    for entry in meta.configs:
        c = entry.config_name
        if infos[c].features != features(c):
            raise CardError(f"{readme}: dataset_info.{c}.features are not the features embodistill writes")
        want = {s.name: s.num_examples for s in next(i for i in meta.dataset_info if i.config_name == c).splits}
        for df in configs[c]["data_files"]:
            paths = df["path"] if isinstance(df["path"], list) else [df["path"]]
            files = sorted(p for pat in paths for p in glob.glob(str(folder / pat)))
            if not files:
                raise CardError(f"{readme}: configs.{c}.{df['split']}: no file matches {paths} in {folder}")
            rows = sum(pq.read_metadata(p).num_rows for p in files)
            if rows != want[df["split"]]:
                raise CardError(f"{readme}: dataset_info.{c}.{df['split']}.num_examples is {want[df['split']]} but "
                                f"the shards hold {rows} rows")
    return meta
