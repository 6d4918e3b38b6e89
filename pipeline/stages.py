"""The stages of a recipe, each a function the CLI and the main job call: build the tasks, distill (teacher ->
judge filter -> dataset), SFT, RL, evaluate, judge. Each writes OUT/ with metrics.json; each takes what it needs
from the recipe and hands it to the stage's own package (`distill/`, `sft/`, `rl/`, `evaluation/`), which never
reads a recipe file itself."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from agent.clients import ClientSpec, TransformersClient, make_client
from agent.llm_builder import LLMBuilder
from agent.llm_persona import LLMHumanAgent
from agent.metrics import DEADLOCK_K, split_metrics
from agent.policies import ChatPolicy
from agent.progress import StageBar
from agent.tools import tool_definitions
from agent.trajectory import numbered_lines, write_json, write_jsonl, write_text_atomic
from distill.card import card_metadata, render_card
from distill.dataset import CONFIGS, SPLITS, DatasetBuildError, build_rows, validation_instructions, write_artifact
from distill.filter import FilterThresholds, filter_stats, judge_and_filter
from distill.onpolicy import collect, make_labeller, round_tasks, sandbox_expert, sandbox_oracle, takeover
from distill.teacher import run_teacher, teacher_description, teacher_name
from evaluation.sandbox_eval import evaluate
from pipeline.recipe import Recipe, RecipeError, format_validation
from reward_engine.judge import LLMBackend, RewardEngine, RuleBackend, VerdictCache
from reward_engine.prompt import default_prompt, load_prompt
from rl.trainer import GiGPOTrainer
from sandbox.gym_env import SandboxEnv
from sandbox.builder import BuildConfig, BuildStats, build_split, compositional_split, target_combos
from sandbox.scenes import load_scene
from sandbox.agents import ExpertAgent
from sandbox.schema import TaskInstance
from sft.train import load_sft_dataset, run_gkd, run_sft
from reward_engine.rules import SANDBOX_ONLY
from textworld_env.games import GameTask, build_games


def build_config(recipe: Recipe) -> BuildConfig:
    s = recipe.sandbox
    return BuildConfig(seed=recipe.seed, budget_factor=s.budget_factor, budget_slack=s.budget_slack,
                       max_budget=s.max_budget, max_attempts=s.max_attempts)


def _builder_factory(recipe: Recipe):
    """`make_builder` for `build_split`: None (procedural) or the recipe's LLM builder."""
    if recipe.sandbox.builder != "llm":
        return None
    client = make_client(recipe.sandbox.builder_model)

    def make(scene, cfg, stats):
        return LLMBuilder(client, cfg, [scene], max_attempts=recipe.sandbox.builder_attempts, stats=stats)
    return make


def _drop_held_out(recipe: Recipe, tasks: list[TaskInstance]) -> tuple[list[TaskInstance], set[str]]:
    """The tasks without every instruction that targets a held-out (type, colour) combination, and those
    instructions' ids (the compositional split keeps them out of training)."""
    holdout = recipe.sandbox.holdout_combos()
    if not holdout:
        return tasks, set()
    held = {t.instruction_id for t in tasks if target_combos(t) & holdout}
    return [t for t in tasks if t.instruction_id not in held], held


def build_tasks(recipe: Recipe, show_progress: bool = True, bar: StageBar | None = None
                ) -> tuple[dict[str, list[TaskInstance]], dict]:
    """Train and test splits, disjoint in instructions and layouts, plus validation statistics. Progress shows on
    `bar` (a stage's bar) or a bar of its own. For `env: textworld`, the games of the recipe's families."""
    if recipe.env == "textworld":
        return _textworld_splits(recipe, show_progress, bar)
    cfg = build_config(recipe)
    scenes = [load_scene(s) for s in recipe.sandbox.scene_list()]
    stats = BuildStats()
    n_train = recipe.sandbox.train_instructions_per_scene
    n_test = recipe.sandbox.test_instructions_per_scene
    make = _builder_factory(recipe)
    own = bar is None
    bar = StageBar("build", enabled=show_progress) if own else bar
    bar.phase("build tasks", len(scenes) * (n_train + n_test), unit="instr")
    train = build_split(scenes, "train", n_train, cfg, stats, difficulties=recipe.sandbox.difficulties,
                        progress=bar.update, make_builder=make)
    train, held = _drop_held_out(recipe, train)
    texts = {t.instruction for t in train}
    layouts = {t.layout_id for t in train}
    test = build_split(scenes, "test", n_test, cfg, stats, forbidden_texts=texts, forbidden_layouts=layouts,
                       difficulties=recipe.sandbox.difficulties, progress=bar.update, make_builder=make)
    if own:
        bar.close()
    out = stats.to_json()
    if recipe.sandbox.holdout_combos():
        out["compositional_holdout"] = {"combinations": sorted(recipe.sandbox.compositional_holdout),
                                        "train_instructions_dropped": len(held)}
    return {"train": train, "test": test}, out


def _textworld_games(recipe: Recipe, counts: dict[str, int], what: str, show_progress: bool,
                     bar: StageBar | None) -> dict[str, list[GameTask]]:
    """{split: games} of a TextWorld recipe, `counts[split]` of each family (built once by makers, then found in
    the cache), with progress on `bar` or a bar of its own."""
    tw = recipe.textworld
    own = bar is None
    bar = StageBar("build", enabled=show_progress) if own else bar
    bar.phase(what, len(tw.games) * sum(counts.values()), unit="game")
    out = {split: build_games(tw.games, split, n, tw.folder, tw.seed, progress=bar.update)
           for split, n in counts.items()}
    if own:
        bar.close()
    return out


def _textworld_splits(recipe: Recipe, show_progress: bool, bar: StageBar | None) -> tuple[dict, dict]:
    tw = recipe.textworld
    splits = _textworld_games(recipe, {"train": tw.train_games_per_family, "test": tw.test_games_per_family},
                              "build games", show_progress, bar)
    return splits, {"games": {k: len(v) for k, v in splits.items()}, "families": [f.label for f in tw.games],
                    "folder": tw.folder}


def compositional_ids(recipe: Recipe, splits: dict) -> set[str]:
    """Ids of the test tasks of the compositional split (sandbox only: TextWorld games name no colour-type
    combinations held out from training)."""
    if recipe.env != "sandbox":
        return set()
    return {t.id for t in compositional_split(splits["train"], splits["test"])}


@dataclass(frozen=True)
class EnvParts:
    """What the stages need of a recipe's env, handed to them (they never choose an env themselves)."""

    make_env: Callable[[], Any]              # a fresh env for the one episode loop
    teacher: Callable[[Any, int], Any]       # the scripted teacher that distills, `factory(env, seed)`
    labeller: Callable[[Any, int], Any]      # the teacher that labels (and takes over from) any state
    oracle: Callable[[Any, int], Any]        # privileged: is a state still solvable?
    tools: list[dict] | None                 # the skills a model is shown (None: the sandbox's)


def env_parts(recipe: Recipe) -> EnvParts:
    """The sandbox's parts (with the recipe's persona), or TextWorld's: its env, its teacher (which takes over
    from any state as it is), the game's own plan as oracle, and `operate` with TextWorld's verbs."""
    if recipe.env == "textworld":
        from textworld_env.env import OPERATE_VERBS, OracleAgent, TextWorldEnv
        from textworld_env.teacher import Teacher
        return EnvParts(TextWorldEnv, Teacher, Teacher, OracleAgent, tool_definitions(OPERATE_VERBS))
    humans = human_factory(recipe)
    return EnvParts(lambda: SandboxEnv(human_factory=humans), ExpertAgent, sandbox_expert, sandbox_oracle, None)


def build_rl_pool(recipe: Recipe, splits: dict[str, list[TaskInstance]], n_per_scene: int,
                  show_progress: bool = False, bar: StageBar | None = None) -> list[TaskInstance]:
    """Fresh tasks for online RL (`rl.task_pool: fresh`): the "rl" split, built like the others (the recipe's
    builder) from its own seed range, with no instruction text or layout of the train or test split and no
    instruction targeting a held-out combination: RL practises on instances like the test split's (new texts,
    new layouts) that no demonstration covered, and the test split stays unseen. For `env: textworld`: the
    games of the "rl" split (`textworld.pool_games_per_family` of each family; `n_per_scene` is not used)."""
    if recipe.env == "textworld":
        return _textworld_games(recipe, {"rl": recipe.textworld.pool_games_per_family}, "build rl games",
                                show_progress, bar)["rl"]
    cfg = build_config(recipe)
    scenes = [load_scene(s) for s in recipe.sandbox.scene_list()]
    texts = {t.instruction for split in splits.values() for t in split}
    layouts = {t.layout_id for split in splits.values() for t in split}
    own = bar is None
    bar = StageBar("build", enabled=show_progress) if own else bar
    bar.phase("build rl tasks", len(scenes) * n_per_scene, unit="instr")
    pool = build_split(scenes, "rl", n_per_scene, cfg, BuildStats(), forbidden_texts=texts, forbidden_layouts=layouts,
                       difficulties=recipe.sandbox.difficulties, progress=bar.update,
                       make_builder=_builder_factory(recipe))
    if own:
        bar.close()
    return _drop_held_out(recipe, pool)[0]


def recipe_hash(recipe: Recipe) -> str:
    return hashlib.sha256(recipe.model_dump_json().encode()).hexdigest()[:16]


def write_build(recipe: Recipe, out: Path, show_progress: bool = True) -> dict:
    splits, stats = build_tasks(recipe, show_progress)
    for split, tasks in splits.items():
        if recipe.env == "textworld":
            write_jsonl(out / f"{split}_games.jsonl", tasks)
            continue
        for diff in ("easy", "medium", "hard"):
            write_jsonl(out / f"{split}_{diff}.jsonl", [t for t in tasks if t.difficulty == diff])
    stats["splits"] = {k: len(v) for k, v in splits.items()}
    write_json(out / "validation.json", stats)
    write_json(out / "manifest.json", {"stage": "build", "recipe": recipe.name, "recipe_hash": recipe_hash(recipe)})
    return stats


def load_tasks(folder: Path, split: str, env: str = "sandbox") -> list[TaskInstance] | list[GameTask]:
    """The tasks `write_build` wrote for a split (TextWorld games with `env="textworld"`, in their order)."""
    model = GameTask if env == "textworld" else TaskInstance
    tasks = []
    files = sorted(folder.glob(f"{split}_*.jsonl"))
    if not files:
        raise RecipeError(f"{folder}: no {split}_*.jsonl task files")
    for f in files:
        for i, line, bad in numbered_lines(f):
            if bad:
                raise RecipeError(f"{f}:{i}: {bad}")
            if not line.strip():
                continue
            try:
                tasks.append(model.model_validate_json(line))
            except ValidationError as e:
                raise RecipeError(format_validation(f"{f}:{i}", e)) from None
    if env == "textworld":
        return tasks
    order = {"easy": 0, "medium": 1, "hard": 2}
    return sorted(tasks, key=lambda t: (order[t.difficulty], t.id))


def human_factory(recipe: Recipe):
    """The recipe's persona mode: None (rule persona) or a factory of LLM-worded personas sharing one cache."""
    if recipe.sandbox.persona != "llm":
        return None
    client, cache = make_client(recipe.sandbox.persona_model), {}
    return lambda compiled: LLMHumanAgent(compiled, client, cache=cache)


def run_eval(recipe: Recipe, policy: str | ClientSpec, split: str, out: Path, tasks_dir: Path | None = None,
             show_progress: bool = True, deadlock_hint: bool = False, instructions: str = "goal",
             deadlock_k: int = DEADLOCK_K) -> dict:
    """Play `policy` (expert, random, a model folder or a client spec) on a split; writes OUT/metrics.json,
    OUT/trajectories.jsonl and OUT/manifest.json. `deadlock_k`: the deadlock window (skill calls); `deadlock_hint`:
    the deadlock intervention. `instructions`: the task line's granularity, goal | step | visual
    (`agent.instructions`)."""
    bar = StageBar("eval", enabled=show_progress)
    if tasks_dir is not None:
        tasks = load_tasks(tasks_dir, split, recipe.env)
    else:
        tasks = build_tasks(recipe, bar=bar)[0][split]
    if recipe.env == "textworld":
        from evaluation.textworld import evaluate_textworld
        if isinstance(policy, ClientSpec):
            bar.close()
            raise RecipeError("TextWorld evaluation takes expert, oracle, random or a model folder, not a client "
                              "spec")
        bar.phase(f"{policy} on {split}", len(tasks), unit="game")
        metrics = evaluate_textworld([Path(t.game) for t in tasks], policy, out, seed=recipe.eval.seed,
                                     progress=bar.update, constrained=recipe.eval.constrained,
                                     deadlock_hint=deadlock_hint, instructions=instructions,
                                     deadlock_k=deadlock_k)
        bar.close()
        metrics["split"] = split
        write_json(out / "metrics.json", metrics)
        return metrics
    name = f"{policy.kind}:{policy.model}" if isinstance(policy, ClientSpec) else policy
    bar.phase(f"{name} on {split}", len(tasks), unit="ep")
    metrics, trajs = evaluate(tasks, policy, seed=recipe.eval.seed, progress=bar.update,
                              human_factory=human_factory(recipe), constrained=recipe.eval.constrained,
                              deadlock_hint=deadlock_hint, instructions=instructions, deadlock_k=deadlock_k)
    bar.close()
    metrics["policy"], metrics["split"] = name, split
    if isinstance(policy, str) and policy not in ("expert", "random"):
        metrics["constrained_decoding"] = recipe.eval.constrained
    write_jsonl(out / "trajectories.jsonl", trajs)
    write_json(out / "metrics.json", metrics)
    write_json(out / "manifest.json", {"stage": "eval", "recipe": recipe.name, "recipe_hash": recipe_hash(recipe),
                                       "policy": name, "split": split,
                                       "tasks_sha256": hashlib.sha256(json.dumps(
                                           [t.id for t in tasks]).encode()).hexdigest()[:16]})
    return metrics


def make_reward_engine(recipe: Recipe, cache_path: Path | None = None):
    """The recipe's reward engine (distillation filter and RL rewards call this)."""
    j = recipe.judge
    prompt = load_prompt(j.prompt) if j.prompt else default_prompt()
    if recipe.env != "sandbox":      # no people, reports or permits there: the sandbox's own checks do not apply
        prompt = prompt.without_checks(SANDBOX_ONLY)
    if j.backend == "llm":
        backend = LLMBackend(make_client(j.model), max_repairs=j.max_repairs, seed=recipe.seed)
    else:
        backend = RuleBackend()
    return RewardEngine(prompt, backend, VerdictCache(cache_path))


def distill_tasks(recipe: Recipe, train: list[TaskInstance]) -> list[TaskInstance]:
    """The train tasks the teacher plays: all, or the first `distill.tasks_per_difficulty` of each difficulty."""
    n = recipe.distill.tasks_per_difficulty
    if n is None:
        return list(train)
    picked = []
    kinds = ("easy", "medium", "hard") if recipe.env == "sandbox" else dict.fromkeys(t.difficulty for t in train)
    for diff in kinds:                  # TextWorld: its game families, in the recipe's order
        picked += [t for t in train if t.difficulty == diff][:n]
    return picked


def run_distill_stage(recipe: Recipe, out: Path, tasks_dir: Path | None = None, restart: bool = False,
                      show_progress: bool = True, client=None) -> dict:
    """Teacher rollouts on the train split -> judge filter -> SFT dataset artifact (parquet + card).

    Writes OUT/teacher/trajectories.jsonl (all episodes, task order), OUT/verdicts.jsonl, OUT/decisions.jsonl,
    OUT/dataset/ (both configs, README.md card), OUT/metrics.json and, last, OUT/manifest.json: the mark that
    the stage completed (`distill_complete`). The previous run's outputs are removed first, so a failed run
    leaves none that look current. The teacher run resumes from OUT/teacher/; judging and the dataset are
    recomputed (they are fast and deterministic), so a rerun gives the same bytes."""
    d = recipe.distill
    t0 = time.time()
    begin_stage(out, DISTILL_OUTPUTS)
    build_stats = None
    bar = StageBar("distill", enabled=show_progress)
    if tasks_dir is not None:
        train = load_tasks(tasks_dir, "train", recipe.env)
    else:
        splits, build_stats = build_tasks(recipe, bar=bar)
        train = splits["train"]
    tasks = distill_tasks(recipe, train)
    if not tasks:
        raise RecipeError("distill: the train split has no tasks (sandbox.train_instructions_per_scene?)")
    persona = {"mode": recipe.sandbox.persona}
    if recipe.sandbox.persona == "llm":
        persona["model"] = recipe.sandbox.persona_model.model
    t1 = time.time()
    parts = env_parts(recipe)
    bar.phase(f"teacher {teacher_name(d.teacher)}", len(tasks), unit="ep")
    try:
        run = run_teacher(tasks, d.teacher, out / "teacher", recipe_seed=recipe.seed, concurrency=d.concurrency,
                          persona=persona, restart=restart, progress=bar.update, show_progress=False,
                          client=client, make_env=parts.make_env, expert=parts.teacher, tools=parts.tools)
    except BaseException:
        bar.close()
        raise
    teacher_s = time.time() - t1
    trajs = run.trajectories
    engine = make_reward_engine(recipe)
    th = FilterThresholds(min_episode_score=d.min_episode_score, max_bad_turn_share=d.max_bad_turn_share,
                          max_loop_share=d.max_loop_share)
    bar.phase("judge filter", len(trajs), unit="traj")
    verdicts, decisions = judge_and_filter(trajs, engine, th, progress=bar.update)
    bar.close()
    write_jsonl(out / "verdicts.jsonl", verdicts)
    write_jsonl(out / "decisions.jsonl", decisions)
    fstats = filter_stats(decisions, verdicts, th)
    kept = [t for t, dec in zip(trajs, decisions, strict=True) if dec.kept]
    scores = {dec.task_id: dec.episode_score for dec in decisions}
    by_id = {t.id: t for t in tasks}
    name = teacher_name(d.teacher)
    try:
        rows, instructions = build_rows(kept, by_id, scores, name, d.validation_fraction, recipe.seed,
                                        tools=parts.tools)
    except DatasetBuildError as e:
        raise DatasetBuildError(f"{out}: {e} (rejected: {fstats['rejected_reasons']}; each episode's reasons are "
                                f"in {out / 'decisions.jsonl'})") from None
    tm = split_metrics(trajs)
    kept_tasks = [by_id[t.task_id] for t in kept]
    prompt = engine.prompt
    about = {"recipe": recipe.name, "seed": recipe.seed, "version": _version(), "tasks": len(tasks),
             "teacher": name, "judge": {"backend": engine.backend.id, "prompt_name": prompt.name,
                                        "prompt_version": prompt.version, "prompt_hash": prompt.content_hash()},
             "filter": fstats, "teacher_tsr": {k: v["tsr"] for k, v in tm.items()},
             "difficulty_mix": _counts(t.difficulty for t in kept_tasks),
             "scenes": _counts(t.scene for t in kept_tasks), "kinds": _counts(t.kind for t in kept_tasks),
             "instructions": instructions}
    pretty = d.pretty_name or f"embodistill {recipe.name}"

    def card_text(sizes, file_sizes):
        meta = card_metadata(sizes, d.license, pretty, d.sample_format, file_sizes)
        return render_card(meta, about)

    write_json(out / "card.json", about)   # what the card says of the run (on-policy distillation re-renders it)
    sizes = write_artifact(out / "dataset", rows, card_text)
    labels = Counter(u.label for v in verdicts for u in v.turns if u.label)
    metrics = {"recipe": recipe.name, "teacher": name, "episodes": len(trajs), "kept": len(kept),
               "rejected": len(trajs) - len(kept), "filter": fstats,
               "teacher_metrics": tm, "resumed": run.resumed, "ran": run.ran, "client": run.client_stats,
               "rows": {c: {s: v["num_examples"] for s, v in sp.items()} for c, sp in sizes.items()},
               "instructions": {k: len(v) for k, v in instructions.items()}, "turn_labels": dict(labels),
               "judge": about["judge"], "teacher_seconds": round(teacher_s, 2), "build": build_stats,
               "seconds": round(time.time() - t0, 2), "dataset": str(out / "dataset")}
    write_json(out / "metrics.json", metrics)
    write_json(out / "manifest.json", {
        "stage": "distill", "recipe": recipe.name, "recipe_hash": recipe_hash(recipe),
        "teacher": teacher_description(d.teacher), "tasks_sha256": hashlib.sha256(json.dumps(
            [t.id for t in tasks]).encode()).hexdigest()[:16], "judge_prompt_hash": prompt.content_hash(),
        "dataset_sha256": {p: hashlib.sha256((out / "dataset" / p).read_bytes()).hexdigest()[:16]
                           for p in sorted(str(x.relative_to(out / "dataset"))
                                           for x in (out / "dataset").rglob("*.parquet"))}})
    return metrics


DISTILL_OUTPUTS = ("manifest.json", "metrics.json", "verdicts.jsonl", "decisions.jsonl", "card.json", "dataset")


def begin_stage(out: Path, outputs: tuple[str, ...]) -> None:
    """Remove a stage's previous outputs (manifest.json, its completion mark, first), so that a run that fails
    leaves nothing from an earlier run beside its own partial outputs."""
    for name in outputs:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def distill_complete(folder: Path) -> bool:
    """Whether the distillation in `folder` completed (its manifest.json is written last)."""
    return (folder / "manifest.json").is_file() and (folder / "dataset" / "README.md").is_file()


def check_dataset(dataset: Path) -> None:
    """Refuse to train on a dataset folder that is missing, or that a distillation which did not complete left."""
    if not (dataset / "README.md").is_file():
        raise FileNotFoundError(f"{dataset}: no dataset there (no README.md): run `embodistill distill` first")
    folder = dataset.parent
    if (folder / "decisions.jsonl").exists() or (folder / "teacher").is_dir():   # a distillation's output folder
        if not distill_complete(folder):
            raise DatasetBuildError(f"{folder}: the last distillation there did not complete (no manifest.json), "
                                    "so its dataset is not current: rerun `embodistill distill RECIPE`")


def _counts(items) -> dict:
    return dict(sorted(Counter(items).items()))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("embodistill")
    except PackageNotFoundError:
        return "0+local"


def run_sft_stage(recipe: Recipe, dataset_dir: Path, out: Path, show_progress: bool = True) -> dict:
    """SFT of the recipe's student on the distilled dataset (`recipe.distill.sample_format` picks the config)."""
    check_dataset(Path(dataset_dir))
    bar = StageBar("sft", enabled=show_progress)
    try:
        return run_sft(recipe.sft, dataset_dir, out, seed=recipe.seed, config=recipe.distill.sample_format, bar=bar)
    finally:
        bar.close()


def rl_init(recipe: Recipe, init: str | Path | None = None) -> tuple[Path, bool]:
    """The RL run's starting checkpoint, and whether this recipe's own stages make it (`rl.init: sft` or
    `onpolicy`)."""
    spec = str(init) if init is not None else recipe.rl.init
    if spec in ("sft", "onpolicy"):
        return Path("outputs") / recipe.name / spec / "final", True
    return Path(spec), False


# ----------------------------------------------------------------------------- on-policy distillation


ONPOLICY_OUTPUTS = ("manifest.json", "metrics.json", "dataset", "final")


def _sha_of_model(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _tsr_by_block(trajs: list, compositional: set[str]) -> dict:
    """TSR (and episodes) per difficulty, all, and the compositional / seen test tasks."""
    m = split_metrics(trajs)
    out = {d: {"tsr": m[d]["tsr"], "episodes": m[d]["episodes"]} for d in ("easy", "medium", "hard", "all") if d in m}
    for name, keep in (("compositional", True), ("seen", False)):
        part = [t for t in trajs if (t.task_id in compositional) == keep]
        if part and compositional:
            out[name] = {"tsr": split_metrics(part)["all"]["tsr"], "episodes": len(part)}
    return out


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _copy_model(src: Path, dst: Path) -> None:
    """Copy a model folder into place whole (a temp folder, then a rename)."""
    tmp = dst.parent / f".{dst.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def onpolicy_key(recipe: Recipe, dataset: Path, init: Path, seed: int) -> dict:
    """What finished rounds depend on: the starting student's weights, the seed, the dataset and the recipe's
    sections before RL (of RL, only which pool there is); a round made for another key is never reused."""
    inputs = recipe.model_dump(mode="json", include={"sandbox", "eval", "judge", "distill", "sft", "onpolicy"})
    inputs["rl_pool"] = recipe.rl.pool_instructions_per_scene
    return {"init_sha256": _sha_of_model(init), "seed": seed,
            "inputs_sha256": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16],
            "dataset_sha256": _sha_of_dataset(dataset)}


def _sha_of_dataset(dataset: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(dataset.rglob("*.parquet")):
        h.update(str(f.relative_to(dataset)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def run_onpolicy_stage(recipe: Recipe, dataset: Path, init: Path, out: Path, restart: bool = False,
                       show_progress: bool = True, client=None, seed: int | None = None) -> dict:
    """On-policy distillation (`distill.onpolicy`): `onpolicy.rounds` rounds, each one

        play      the current student plays this round's tasks (train split and/or the RL pool) through the
                  one episode loop; the teacher labels every state it reaches (DAgger's beta mixes them)
        takeover  at a random state of some of those episodes the expert takes over: how recoverable are they?
        aggregate the round's rows join the dataset as its `onpolicy` config (OUT/dataset: step,
                  conversation and onpolicy, with the card)
        train     the student continues with TRL's SFTTrainer on every on-policy row so far plus the teacher's
                  rows (`onpolicy.teacher_rows`), from the round's starting student
        evaluate  the new student's greedy TSR on the test split (per difficulty, compositional and seen)

    Writes OUT/round-R/ (rows.jsonl, trajectories.jsonl, collect.json, student/, and metrics.json last: the
    round is done), OUT/dataset/, OUT/final/ (the last round's student), OUT/metrics.json and, last,
    OUT/manifest.json. Resumable per round: finished rounds are reused; an interrupted round plays again from its
    start (its rows are written once, whole) and its training resumes from its checkpoints. Rounds made for
    other inputs (another starting student, recipe or seed) are discarded."""
    cfg = recipe.onpolicy
    seed = recipe.seed if seed is None else seed
    check_dataset(dataset)
    card_json = dataset.parent / "card.json"
    if not card_json.is_file():
        raise DatasetBuildError(f"{dataset.parent}: no card.json (the distillation predates on-policy "
                                "distillation): rerun `embodistill distill RECIPE`")
    if not (init / "config.json").is_file():
        raise FileNotFoundError(f"{init}: no student there (no config.json) to start on-policy distillation from")
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    key = onpolicy_key(recipe, dataset, init, seed)
    old_key = json.loads((out / "key.json").read_text()) if (out / "key.json").is_file() else None
    if restart or old_key != key:
        for d in out.glob("round-*"):
            shutil.rmtree(d)
    begin_stage(out, ONPOLICY_OUTPUTS)
    write_json(out / "key.json", key)

    bar = StageBar("onpolicy", enabled=show_progress)
    splits = build_tasks(recipe, bar=bar)[0]
    pool = build_rl_pool(recipe, splits, recipe.rl.pool_instructions_per_scene, bar=bar) if cfg.tasks != "train" \
        else []
    candidates = {"train": splits["train"], "pool": pool, "both": splits["train"] + pool}[cfg.tasks]
    test = splits["test"]
    if cfg.eval_tasks is not None:
        test = sorted(test, key=lambda t: hashlib.sha256(f"{recipe.eval.seed}|{t.id}".encode()).hexdigest())
        test = test[:cfg.eval_tasks]
    compositional = compositional_ids(recipe, splits)
    about = json.loads(card_json.read_text())
    known_val = set(about["instructions"]["validation"])
    train_instr = set(about["instructions"]["train"])
    fresh = sorted({t.instruction_id for t in pool} - known_val - train_instr)
    validation = known_val | validation_instructions(fresh, recipe.distill.validation_fraction, seed)
    parts = env_parts(recipe)
    make_env, tools = parts.make_env, parts.tools
    name = teacher_name(cfg.teacher)

    def evaluate_student(folder: Path, label: str) -> dict:
        bar.phase(f"{label}: test split", len(test), unit="ep")
        m, trajs = evaluate(test, str(folder), seed=recipe.eval.seed, progress=bar.update,
                            batch_size=cfg.batch_size, make_env=make_env, tools=tools,
                            constrained=recipe.eval.constrained)   # decoded as `embodistill eval` decodes
        return _tsr_by_block(trajs, compositional)

    rounds = []
    if cfg.eval_init:
        r0 = out / "round-0"
        if not (r0 / "metrics.json").is_file():
            t1 = time.time()
            write_json(r0 / "metrics.json", {"round": 0, "student": str(init),
                                             "test": evaluate_student(init, "round 0 (the starting student)"),
                                             "eval_seconds": round(time.time() - t1, 1)})
        rounds.append(json.loads((r0 / "metrics.json").read_text()))
    student, rows = init, []
    for r in range(1, cfg.rounds + 1):
        rd = out / f"round-{r}"
        if (rd / "metrics.json").is_file():        # a finished round: reused
            rows += _read_rows(rd / "rows.jsonl")
            student = rd / "student" / "final"
            rounds.append(json.loads((rd / "metrics.json").read_text()))
            continue
        # 1. the student plays, the teacher labels every state it reaches
        t1 = time.time()
        if not (rd / "rows.jsonl").is_file() or not (rd / "collect.json").is_file():
            tasks = round_tasks(candidates, cfg.tasks_per_round, seed, r)
            bar.phase(f"round {r}: student plays, {name} labels", len(tasks), unit="ep")
            student_client = TransformersClient(student, max_new_tokens=cfg.max_new_tokens,
                                                temperature=cfg.temperature, seed=seed, batch_size=cfg.batch_size)
            got = collect(make_env, ChatPolicy(student_client, name="student", tools=tools),
                          make_labeller(cfg.teacher, client, expert=parts.labeller, tools=tools),
                          tasks, seed, r, beta=cfg.beta_for(r), batch_size=cfg.batch_size, validation=validation,
                          teacher_name=name, max_error_share=cfg.max_teacher_error_share, progress=bar.update)
            # 2. how recoverable are the states it reached?
            bar.phase(f"round {r}: expert takes over", 1, unit="run")
            took = takeover(make_env, got.played.trajectories, {t.id: t for t in tasks}, seed * 1000 + r,
                            cfg.takeover_episodes, expert=parts.labeller, oracle=parts.oracle)
            bar.update(1)
            write_jsonl(rd / "trajectories.jsonl", got.played.trajectories)
            write_text_atomic(rd / "rows.jsonl", "".join(json.dumps(x) + "\n" for s in ("train", "validation")
                                                         for x in got.rows[s]))
            write_json(rd / "collect.json", {**got.stats, "takeover": took, "seconds": round(time.time() - t1, 1)})
        collected = json.loads((rd / "collect.json").read_text())
        rows += _read_rows(rd / "rows.jsonl")
        # 3. the aggregate: the distilled dataset plus every on-policy row so far, as its `onpolicy` config
        write_onpolicy_dataset(recipe, dataset, out / "dataset", rows, validation, about, rounds, collected)
        # 4. the student continues on the aggregate
        t2 = time.time()
        sft_cfg = recipe.sft.model_copy(update={"epochs": cfg.epochs, "lr": cfg.lr, "lm_epochs": 0.0,
                                                "max_steps": -1})
        caps = {"step": cfg.teacher_rows} if cfg.teacher_rows is not None else None
        if cfg.loss == "gkd":   # the teacher model's token distributions on the collected student prompts
            sm = run_gkd(sft_cfg, out / "dataset", rd / "student", init=student, teacher=cfg.teacher.model,
                         seed=seed + r, lmbda=cfg.gkd_lmbda, beta=cfg.gkd_beta, max_new_tokens=cfg.max_new_tokens,
                         config=("step", "onpolicy"), rows_per_config=caps, bar=bar)
        else:
            sm = run_sft(sft_cfg, out / "dataset", rd / "student", seed=seed + r, config=("step", "onpolicy"),
                         bar=bar, init=student, rows_per_config=caps)
        train_s = time.time() - t2
        student = rd / "student" / "final"
        # 5. how good is it now?
        t3 = time.time()
        test_m = evaluate_student(student, f"round {r}")
        m = {"round": r, "student": str(student), "collect": collected, "rows_so_far": len(rows),
             "train": {k: sm.get(k) for k in ("train_samples", "steps", "train_loss", "eval_loss", "train_seconds")},
             "train_seconds": round(train_s, 1), "test": test_m, "eval_seconds": round(time.time() - t3, 1),
             "seconds": round(time.time() - t1, 1)}
        write_json(rd / "metrics.json", m)
        rounds.append(m)
    bar.close()
    _copy_model(student, out / "final")
    if not (out / "dataset" / "README.md").is_file():   # every round was reused: the aggregate is rewritten
        write_onpolicy_dataset(recipe, dataset, out / "dataset", rows, validation, about, rounds, None)
    metrics = {"recipe": recipe.name, "teacher": name, "rounds": rounds, "rows": len(rows), "final": str(out / "final"),
               "init": str(init), "seconds": round(time.time() - t0, 1)}
    write_json(out / "metrics.json", metrics)
    write_json(out / "manifest.json", {"stage": "onpolicy", "init": str(init), **key, "rounds": cfg.rounds})
    return metrics


def write_onpolicy_dataset(recipe: Recipe, dataset: Path, out: Path, rows: list[dict], validation: set[str],
                           about: dict, rounds: list[dict], last: dict | None) -> dict:
    """OUT: the distilled dataset's configs plus `onpolicy` (every on-policy row so far), with the card."""
    loaded = {c: load_sft_dataset(dataset, c) for c in CONFIGS}
    base = {c: {s: loaded[c][s].to_list() for s in SPLITS} for c in CONFIGS}
    if not any(x["instruction_id"] in validation for x in rows):
        # no on-policy row comes from a validation instruction yet: hold out a share of the rows' own instructions
        validation = validation_instructions([x["instruction_id"] for x in rows], recipe.distill.validation_fraction,
                                             recipe.seed)
        if not validation:
            raise DatasetBuildError(f"{out}: the on-policy rows come from {len({x['instruction_id'] for x in rows})} "
                                    "instruction(s); a validation split needs at least 2 (onpolicy.tasks_per_round?)")
    base["onpolicy"] = {s: [x for x in rows if (x["instruction_id"] in validation) == (s == "validation")]
                        for s in SPLITS}
    done = [r["collect"] for r in rounds if r.get("round", 0) > 0 and "collect" in r] + ([last] if last else [])
    info = {**about, "onpolicy": {"teacher": teacher_name(recipe.onpolicy.teacher),
                                  "tasks": recipe.onpolicy.tasks_per_round,
                                  "rounds": [{"round": c["round"], "beta": c["beta"], "rows": sum(c["rows"].values()),
                                              "agreement": c["agreement"], "student_tsr": c["student_tsr"]}
                                             for c in done]}}
    d = recipe.distill

    def card_text(sizes, file_sizes):
        meta = card_metadata(sizes, d.license, d.pretty_name or f"embodistill {recipe.name}", d.sample_format,
                             file_sizes, extra_tags=("on-policy-distillation", "dagger"))
        return render_card(meta, info)

    return write_artifact(out, base, card_text)


def make_rl_trainer(recipe: Recipe, out: Path, init: Path, algorithm: str | None = None, seed: int | None = None,
                    iterations: int | None = None, resume: bool = False, restart: bool = False,
                    show_progress: bool = True, cpu: bool | None = None) -> GiGPOTrainer:
    """The RL run of a recipe: its task pool (`rl.task_pool`), test split, reward engine and persona handed to
    `rl.trainer.GiGPOTrainer`, which starts from the checkpoint `init`. `algorithm`, `seed` and `iterations`
    override the recipe. The RL stage's one progress bar shows the tasks being built, then the iterations."""
    cfg = recipe.rl
    updates = {k: v for k, v in (("algorithm", algorithm), ("iterations", iterations)) if v is not None}
    if updates:
        cfg = type(cfg).model_validate({**cfg.model_dump(), **updates})
    bar = StageBar("rl", enabled=show_progress)
    splits = build_tasks(recipe, bar=bar)[0]
    pool = splits["train"] if cfg.task_pool == "train" else build_rl_pool(recipe, splits,
                                                                        cfg.pool_instructions_per_scene, bar=bar)
    compositional = compositional_ids(recipe, splits)
    parts = env_parts(recipe)
    return GiGPOTrainer(cfg, init, out, pool, splits["test"], make_reward_engine(recipe),
                        seed=recipe.seed if seed is None else seed, eval_seed=recipe.eval.seed,
                        eval_constrained=recipe.eval.constrained,
                        compositional=compositional, name=recipe.name, resume=resume, restart=restart,
                        show_progress=show_progress, cpu=cpu, bar=bar, make_env=parts.make_env, tools=parts.tools)


def run_rl_stage(recipe: Recipe, out: Path, init: Path, **options) -> dict:
    """GiGPO (or GRPO) from the checkpoint `init` (`make_rl_trainer` takes the options). Writes OUT/
    (checkpoints/, final/, metrics.jsonl, metrics.json, curves.png) and returns the run's summary (on the main
    process)."""
    trainer = make_rl_trainer(recipe, out, init, **options)
    try:
        return trainer.train()
    finally:
        trainer.bar.close()
