"""The `embodistill` command line: one command per stage, and `rl`, the main job."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from tqdm import tqdm

from agent.instructions import GRANULARITIES
from agent.metrics import DEADLOCK_K
from distill.card import CardError
from distill.dataset import DatasetBuildError
from distill.hub import PushError, push_dataset
from distill.onpolicy import OnPolicyError
from distill.teacher import TeacherError
from pipeline.console import stage_log
from pipeline.main_job import run_main_job
from pipeline.recipe import RecipeError, load_client_spec, load_recipe
from pipeline.reward_stages import (run_audit, run_evolve, run_export_disputed, run_judge,
                                    run_oracle_labels)
from pipeline.stages import (distill_complete, run_distill_stage, run_eval, run_onpolicy_stage, run_sft_stage,
                             write_build)
from pipeline.verl import write_dataset as write_verl_dataset
from rl.trainer import RLError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Distill small embodied agents.")


JUDGE_ERRORS_EXIT = 3   # `judge`: judged, but too many turn judgments failed


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code=2)


@app.command()
def build(recipe: Path = typer.Argument(..., help="recipe YAML"),
          out: Path = typer.Option(..., "--out", help="output folder for task JSONL and validation.json"),
          quiet: bool = typer.Option(False, help="no progress bar")):
    """Build the recipe's task instances (train/test x easy/medium/hard) and validate them."""
    try:
        r = load_recipe(recipe)
        stats = write_build(r, out, show_progress=not quiet)
    except RecipeError as e:
        _fail(str(e))
    keys = ("games", "families", "folder") if r.env == "textworld" else ("total", "accepted", "rejected",
                                                                         "expert_solved", "splits")
    typer.echo(json.dumps({k: stats[k] for k in keys}))


def _pixel_recipe(recipe: Path, episodes: int):
    """The recipe of a pixel evaluation (its eval seed), after checking the episode count."""
    if episodes < 1:
        _fail(f"--episodes must be >= 1, not {episodes}")
    try:
        return load_recipe(recipe)
    except RecipeError as e:
        _fail(str(e))


@app.command("eval")
def eval_cmd(recipe: Path = typer.Argument(..., help="recipe YAML"),
             policy: str = typer.Option("expert", help="expert | random | PATH (a model folder, e.g. "
                                                       "outputs/tiny/sft/final) | SPEC.yaml (a client spec: "
                                                       "{kind: openai, model: M, base_url: URL}, sandbox only)"),
             split: str = typer.Option("test", help="train | test (sandbox only)"),
             out: Path = typer.Option(..., "--out", help="output folder for metrics.json"),
             tasks: Optional[Path] = typer.Option(None, help="folder written by `embodistill build` (else built)"),
             env: str = typer.Option("sandbox", help="sandbox, babyai:LEVEL for pixel evaluation on a BabyAI "
                                                     "level (a short name such as babyai:GoTo, or any "
                                                     "registered id: babyai:BabyAI-UnlockLocal-v0), "
                                                     "browser:TASK for a browser task "
                                                     "from evaluation/browser_tasks.yaml (e.g. browser:click-button), "
                                                     "or textworld:PATH for TextWorld games (a .z8/.ulx file or a "
                                                     "folder of them; --policy expert | oracle | random | PATH)"),
             interface: str = typer.Option("computer", help="browser: computer (click/move/key/type at screenshot "
                                                            "pixels) | semantic (the task's named actions)"),
             episodes: int = typer.Option(50, help="babyai: episodes (seeds from the recipe's eval seed)"),
             view: str = typer.Option("topdown", help="babyai: topdown (the whole frame) | topdown-fov (objects "
                                                      "only inside the highlighted field of view) | egocentric "
                                                      "(the agent's own 7x7 view)"),
             vision_model: Optional[str] = typer.Option(None, help="babyai/browser: perceive frames with this "
                                                                   "OpenAI-compatible vision model instead of the "
                                                                   "sprite detector / Tesseract"),
             vision_base_url: Optional[str] = typer.Option(None, help="babyai/browser: the vision model's "
                                                                      "endpoint"),
             deadlock_hint: bool = typer.Option(False, "--deadlock-hint",
                                                help="sandbox/textworld: after 3 calls in a row that change "
                                                     "nothing (babyai: 16 turns), the next observation says so "
                                                     "(the deadlock intervention; metrics.json shows recovery "
                                                     "with it)"),
             deadlock_window: Optional[int] = typer.Option(None, help="the deadlock window K: decisions in a row "
                                                                      "that change nothing (default: 3 skill "
                                                                      "calls; babyai: 16 turns)"),
             instructions: str = typer.Option("goal", help="sandbox/babyai/textworld: the task line a model "
                                                           "reads: goal (the instruction) | step (and the plan's "
                                                           "ordered steps) | visual (the steps with where the "
                                                           "agent has seen their things)"),
             quiet: bool = typer.Option(False, help="no progress bar")):
    """Run a policy on a split (sandbox), on a BabyAI level from RGB frames (babyai:LEVEL), on a browser task or
    on TextWorld games (textworld:PATH) and write metrics.json: TSR, GCR, steps, invalid-action rate per
    difficulty; or success with a Wilson interval, steps against BabyAI's bot, deadlocks and perception accuracy,
    with report.md and frame strips; or games won per game type and level with Wilson intervals."""
    spec = Path(policy).is_file() and Path(policy).suffix in (".yaml", ".yml", ".json")
    if deadlock_window is not None and deadlock_window < 2:
        _fail(f"--deadlock-window must be >= 2 decisions, not {deadlock_window}")
    k = deadlock_window or DEADLOCK_K
    if instructions not in GRANULARITIES:
        _fail(f"--instructions must be one of {', '.join(GRANULARITIES)}, not {instructions!r}")
    if instructions != "goal" and env.startswith("browser:"):
        _fail("--instructions step|visual is for the sandbox, BabyAI and TextWorld, not browser tasks")
    if env.startswith("textworld:"):
        _eval_textworld(recipe, env.split(":", 1)[1], policy, out, quiet, deadlock_hint, instructions, k)
        return
    if (deadlock_hint or deadlock_window) and env.startswith("browser:"):
        _fail("--deadlock-hint and --deadlock-window are for the sandbox, BabyAI and TextWorld games, not browser "
              "tasks (yet)")
    if policy not in ("expert", "random", "oracle") and not spec and not (Path(policy) / "config.json").is_file():
        _fail(f"--policy must be expert, random, a model folder with config.json or a client spec file (.yaml), "
              f"not {policy!r} (oracle: TextWorld only)")
    if policy == "oracle" and env != "sandbox":
        _fail("--policy oracle is the TextWorld game's own plan: --env textworld:PATH or a textworld recipe")
    if env.startswith("babyai:"):
        # the pixel extra (minigrid): imported only when asked for
        from evaluation.babyai import VIEWS, LevelError, evaluate_babyai, level_id
        level = env.split(":", 1)[1]
        try:
            level_id(level)
        except LevelError as e:
            _fail(str(e))
        if view not in VIEWS:
            _fail(f"--view must be one of {', '.join(VIEWS)}, not {view!r}")
        r = _pixel_recipe(recipe, episodes)
        bar = tqdm(total=episodes, desc=f"{policy} on {level}", unit="ep", disable=quiet)
        try:
            m = evaluate_babyai(level, policy, episodes, out, seed=r.eval.seed, view=view, progress=bar.update,
                                vision_model=vision_model, vision_base_url=vision_base_url,
                                constrained=r.eval.constrained and policy not in ("expert", "random"),
                                instructions=instructions, deadlock_hint=deadlock_hint,
                                deadlock_turns=deadlock_window or 16)
        except LevelError as e:   # a mission or a cell the skills cannot express
            _fail(str(e))
        finally:
            bar.close()
        typer.echo(json.dumps({k: m[k] for k in ("level", "policy", "instructions", "episodes", "success_rate",
                                                 "success_wilson95",
                                                 "mean_steps", "step_ratio_to_bot", "invalid_action_rate",
                                                 "deadlocks", "perception_accuracy")}))
        return
    if env.startswith("browser:"):
        # the browser extra (playwright): imported only when asked for
        from evaluation.browser import INTERFACES, BrowserUnavailable, evaluate_browser, get_task
        task = env.split(":", 1)[1]
        try:
            get_task(task)
        except ValueError as e:
            _fail(str(e))
        if interface not in INTERFACES:
            _fail(f"--interface must be one of {', '.join(INTERFACES)}, not {interface!r}")
        r = _pixel_recipe(recipe, episodes)
        bar = tqdm(total=episodes, desc=f"{policy} on {task}", unit="ep", disable=quiet)
        try:
            m = evaluate_browser(task, policy, episodes, out, seed=r.eval.seed, interface=interface,
                                 progress=bar.update, vision_model=vision_model, vision_base_url=vision_base_url)
        except BrowserUnavailable as e:
            _fail(str(e))
        bar.close()
        typer.echo(json.dumps({k: m[k] for k in ("task", "policy", "interface", "episodes", "success_rate",
                                                 "success_wilson95", "progress", "mean_steps", "invalid_action_rate",
                                                 "no_tool_call_rate", "out_of_space_rate", "env_failures")}))
        return
    if env != "sandbox":
        _fail(f"--env must be sandbox, babyai:LEVEL, browser:TASK or textworld:PATH, not {env!r}")
    if split not in ("train", "test"):
        _fail(f"--split must be train or test, not {split!r}")
    try:
        r = load_recipe(recipe)
        if policy == "oracle" and r.env != "textworld":
            _fail("--policy oracle is the TextWorld game's own plan: a recipe with env: textworld, or "
                  "--env textworld:PATH")
        m = run_eval(r, load_client_spec(policy) if spec else policy, split, out, tasks, show_progress=not quiet,
                     deadlock_hint=deadlock_hint, instructions=instructions, deadlock_k=k)
    except RecipeError as e:
        _fail(str(e))
    if r.env == "textworld":
        typer.echo(_textworld_summary(m))
        return
    typer.echo(json.dumps({**{d: {"tsr": m[d]["tsr"], "gcr": m[d]["gcr"], "episodes": m[d]["episodes"]}
                              for d in ("easy", "medium", "hard", "all")}, "instructions": instructions,
                           "deadlocks": _deadlocks(m)}))


def _eval_textworld(recipe: Path, games: str, policy: str, out: Path, quiet: bool, deadlock_hint: bool = False,
                    instructions: str = "goal", deadlock_k: int = DEADLOCK_K) -> None:
    """`eval --env textworld:PATH`: every game at PATH (a `.z8`/`.ulx` file or a folder of them, from tw-make)."""
    # the textworld extra: imported only when asked for
    from evaluation.textworld import SCRIPTED, GameFolderError, evaluate_textworld, find_games
    if policy not in SCRIPTED and not (Path(policy) / "config.json").is_file():
        _fail(f"--policy must be {', '.join(SCRIPTED)} or a model folder with config.json, not {policy!r}")
    try:
        r = load_recipe(recipe)
        paths = find_games(games)
    except (RecipeError, GameFolderError) as e:
        _fail(str(e))
    bar = tqdm(total=len(paths), desc=f"{policy} on {games}", unit="game", disable=quiet)
    m = evaluate_textworld(paths, policy, out, seed=r.eval.seed, progress=bar.update,
                           constrained=r.eval.constrained and policy not in SCRIPTED, deadlock_hint=deadlock_hint,
                           instructions=instructions, deadlock_k=deadlock_k)
    bar.close()
    typer.echo(_textworld_summary(m))


def _textworld_summary(m: dict) -> str:
    return json.dumps({"policy": m["policy"], "instructions": m["instructions"], "games": m["games"],
                       **{k: m["all"][k] for k in (
        "won_rate", "won_wilson95", "score_ratio", "mean_steps", "steps_over_walkthrough", "invalid_call_rate")},
        "by_type": {k: v["won_rate"] for k, v in m["by_type"].items()}, "deadlocks": _deadlocks(m)})


def _deadlocks(m: dict) -> dict:
    d = m["deadlocks"]
    return {k: d[k] for k in ("k", "aware", "unaware", "recovered", "failed_with_aware", "failed_with_unaware",
                              "hint")}


@app.command()
def judge(trajectories: Path = typer.Option(..., "--trajectories", help="trajectory JSONL (agent.trajectory)"),
          out: Path = typer.Option(..., "--out", help="output folder: verdicts.jsonl, summary.json, prompt.json"),
          backend: str = typer.Option("rule", help="rule (offline, deterministic) | openai (any OpenAI-compatible "
                                                   "endpoint)"),
          model: Optional[str] = typer.Option(None, help="model name for --backend openai"),
          base_url: Optional[str] = typer.Option(None, help="endpoint for --backend openai, e.g. a vLLM server"),
          api_key_env: str = typer.Option("OPENAI_API_KEY", help="environment variable that holds the key"),
          prompt: Optional[Path] = typer.Option(None, help="reward prompt snapshot JSON (default: embedded v1)"),
          cache: Optional[Path] = typer.Option(None, help="verdict cache JSONL (default: OUT/cache.jsonl)"),
          max_error_share: float = typer.Option(0.0, help="the largest share of turn judgments that may fail (the "
                                                         "endpoint's errors, unparseable replies) before the "
                                                         "command exits with code 3"),
          quiet: bool = typer.Option(False, help="no progress bar")):
    """Judge trajectories: turn verdicts and episode scores as JSONL, plus DIR/summary.json. Exit codes: 0 done;
    2 bad input; 3 judged, but more turn judgments failed than --max-error-share allows (the outputs are
    written; an episode with a failed turn gets no episode score)."""
    if backend not in ("rule", "openai"):
        _fail(f"--backend must be rule or openai, not {backend!r}")
    if backend == "openai" and not model:
        _fail("--backend openai needs --model")
    if not trajectories.is_file():
        _fail(f"--trajectories {trajectories}: no such file")
    if not 0.0 <= max_error_share <= 1.0:
        _fail(f"--max-error-share must be in [0, 1], not {max_error_share}")
    try:
        s = run_judge(trajectories, out, backend=backend, model=model, base_url=base_url, api_key_env=api_key_env,
                      prompt_path=prompt, cache_path=cache, show_progress=not quiet)
    except (RecipeError, ValueError) as e:
        _fail(str(e))
    if s["trajectories"] == 0:
        first = s["bad_line_errors"][0] if s["bad_line_errors"] else None
        _fail(f"{trajectories}: no trajectory to judge" + (f" ({s['bad_lines']} bad lines; line {first['line']}: "
                                                           f"{first['error']})" if first else ""))
    typer.echo(json.dumps({k: s[k] for k in ("trajectories", "mean_episode_score", "labels", "judge_error",
                                             "judge_error_share", "bad_lines")}))
    for b in s["bad_line_errors"]:
        typer.echo(f"warning: {trajectories}:{b['line']}: {b['error']}", err=True)
    if s["judge_error_share"] > max_error_share:
        typer.echo(f"error: {s['judge_error']} of {s['turns']} turn judgments failed (share "
                   f"{s['judge_error_share']}, more than --max-error-share {max_error_share}); see "
                   f"{out / 'verdicts.jsonl'} (judge_error) and {out / 'summary.json'}", err=True)
        raise typer.Exit(code=JUDGE_ERRORS_EXIT)


@app.command()
def distill(recipe: Path = typer.Argument(..., help="recipe YAML"),
            out: Optional[Path] = typer.Option(None, "--out", help="output folder (default outputs/<recipe>/distill)"),
            tasks: Optional[Path] = typer.Option(None, help="folder written by `embodistill build` (else built)"),
            restart: bool = typer.Option(False, help="discard a partial teacher run instead of resuming it"),
            quiet: bool = typer.Option(False, help="no progress bar")):
    """Teacher rollouts on the train split, the judge filter, and the SFT dataset (parquet + card)."""
    try:
        r = load_recipe(recipe)
        folder = out or Path("outputs") / r.name / "distill"
        with stage_log(folder):
            m = run_distill_stage(r, folder, tasks, restart=restart, show_progress=not quiet)
    except (RecipeError, TeacherError, DatasetBuildError) as e:
        _fail(str(e))
    typer.echo(json.dumps({k: m[k] for k in ("episodes", "kept", "rejected", "rows", "dataset")}))


@app.command("push-dataset")
def push_dataset_cmd(folder: Path = typer.Argument(..., help="dataset folder written by `embodistill distill`"),
                     repo: str = typer.Option(..., "--repo", help="ORG/NAME on the Hugging Face Hub"),
                     private: bool = typer.Option(False, help="create the repo as private"),
                     token_env: str = typer.Option("HF_TOKEN", help="environment variable that holds the token")):
    """Validate the dataset folder offline, then push every config and the card to the Hub."""
    try:
        res = push_dataset(folder, repo, private=private, token_env=token_env)
    except (CardError, PushError) as e:
        _fail(str(e))
    typer.echo(json.dumps(res))


@app.command()
def sft(recipe: Path = typer.Argument(..., help="recipe YAML"),
        dataset: Optional[Path] = typer.Option(None, help="dataset folder (default outputs/<recipe>/distill/dataset)"),
        out: Optional[Path] = typer.Option(None, "--out", help="output folder (default outputs/<recipe>/sft)"),
        quiet: bool = typer.Option(False, help="no progress bar")):
    """Train the recipe's student with TRL SFT (assistant-only loss); resumes from the last checkpoint. Without
    --dataset, the recipe's distillation runs first when outputs/<recipe>/distill/dataset is missing."""
    try:
        r = load_recipe(recipe)
        ds = dataset or Path("outputs") / r.name / "distill" / "dataset"
        if dataset is None and not distill_complete(ds.parent):
            typer.echo(f"{ds} is missing or incomplete: running `embodistill distill` first", err=True)
            with stage_log(ds.parent):
                run_distill_stage(r, ds.parent, show_progress=not quiet)
        folder = out or Path("outputs") / r.name / "sft"
        with stage_log(folder):
            m = run_sft_stage(r, ds, folder, show_progress=not quiet)
    except (RecipeError, FileNotFoundError, ValueError, TeacherError, DatasetBuildError) as e:
        _fail(str(e))
    typer.echo(json.dumps({k: m[k] for k in ("train_samples", "params", "steps", "train_loss", "eval_loss",
                                             "final")}))


@app.command()
def onpolicy(recipe: Path = typer.Argument(..., help="recipe YAML (its onpolicy: section)"),
             init: Optional[Path] = typer.Option(None, help="the starting student (default: "
                                                          "outputs/<recipe>/sft/final, made first when missing)"),
             out: Optional[Path] = typer.Option(None, "--out",
                                                help="output folder (default outputs/<recipe>/onpolicy)"),
             seed: Optional[int] = typer.Option(None, help="override the recipe seed (tasks stay the recipe's)"),
             restart: bool = typer.Option(False, help="discard finished rounds instead of reusing them"),
             quiet: bool = typer.Option(False, help="no progress bar")):
    """On-policy distillation: the student plays, the teacher labels every state it reaches, the student trains on
    the aggregate; `onpolicy.rounds` rounds, each resumable. Without --init, the recipe's distillation and SFT run
    first when their outputs are missing."""
    try:
        r = load_recipe(recipe)
        base = Path("outputs") / r.name
        ds = base / "distill" / "dataset"
        if not distill_complete(ds.parent):
            typer.echo(f"{ds} is missing or incomplete: running `embodistill distill` first", err=True)
            with stage_log(ds.parent):
                run_distill_stage(r, ds.parent, show_progress=not quiet)
        start = init or base / "sft" / "final"
        if init is None and not ((base / "sft" / "manifest.json").is_file() and (start / "config.json").is_file()):
            typer.echo(f"{start} is missing: running `embodistill sft` first", err=True)
            with stage_log(base / "sft"):
                run_sft_stage(r, ds, base / "sft", show_progress=not quiet)
        folder = out or base / "onpolicy"
        with stage_log(folder):
            m = run_onpolicy_stage(r, ds, start, folder, restart=restart, show_progress=not quiet, seed=seed)
    except (RecipeError, FileNotFoundError, ValueError, TeacherError, DatasetBuildError, OnPolicyError) as e:
        _fail(str(e))
    typer.echo(json.dumps({"rounds": [{"round": x["round"], "test_tsr": x["test"].get("all", {}).get("tsr"),
                                       "agreement": (x.get("collect") or {}).get("agreement")} for x in m["rounds"]],
                           "rows": m["rows"], "final": m["final"]}))


@app.command()
def rl(recipe: Path = typer.Argument(..., help="recipe YAML (its rl: section)"),
       algorithm: Optional[str] = typer.Option(None, help="gigpo | grpo (default: the recipe's rl.algorithm)"),
       init: Optional[str] = typer.Option(None, help="starting model folder (default: the recipe's rl.init)"),
       out: Optional[Path] = typer.Option(None, "--out", help="default outputs/<recipe>/rl/<algorithm>"),
       seed: Optional[int] = typer.Option(None, help="override the recipe seed for this run"),
       iterations: Optional[int] = typer.Option(None, help="override rl.iterations"),
       resume: bool = typer.Option(False, help="continue from the last checkpoint in OUT"),
       restart: bool = typer.Option(False, help="discard OUT and start over"),
       quiet: bool = typer.Option(False, help="no progress bars")):
    """The main job: online RL of the recipe's student (GiGPO, or GRPO), after the distillation and SFT it starts
    from when they are missing; ends with a table of what each stage did. `accelerate launch rl/train_gigpo.py
    RECIPE` runs this command under accelerate (several processes: DDP)."""
    if algorithm not in (None, "gigpo", "grpo"):
        _fail(f"--algorithm must be gigpo or grpo, not {algorithm!r}")
    try:
        run_main_job(recipe, init=init, algorithm=algorithm, out=out, seed=seed, iterations=iterations,
                     resume=resume, restart=restart, quiet=quiet)
    except (RecipeError, RLError, TeacherError, DatasetBuildError, OnPolicyError, FileNotFoundError, ValueError) as e:
        _fail(str(e))


@app.command("verl-data")
def verl_data(recipe: Path = typer.Argument(..., help="recipe YAML"),
              out: Path = typer.Option(..., "--out", help="folder for train.parquet and val.parquet"),
              quiet: bool = typer.Option(False, help="no progress bar")):
    """verl's RL dataset from the recipe's tasks (one row per task, its first step prompt and the task as JSON),
    for `data.train_files` / `data.val_files` of a verl run (recipes/gpu/README.md)."""
    try:
        paths = write_verl_dataset(recipe, out, show_progress=not quiet)
    except (RecipeError, ValueError) as e:
        _fail(str(e))
    typer.echo(json.dumps({split: str(path) for split, path in paths.items()}))


_BACKEND_HELP = "rule (offline, deterministic) | openai (any OpenAI-compatible endpoint)"


@app.command("oracle-labels")
def oracle_labels(recipe: Path = typer.Argument(..., help="recipe YAML"),
                  out: Path = typer.Option(..., "--out", help="output folder: trajectories.jsonl, labels.jsonl, "
                                                             "summary.json"),
                  policies: str = typer.Option("expert,noisy,random", help="comma-separated: expert, noisy "
                                                                           "(expert with typed mistakes), random"),
                  split: str = typer.Option("all", help="train | test | all"),
                  limit: Optional[int] = typer.Option(None, help="first N tasks only"),
                  gzip: bool = typer.Option(False, "--gzip", help="write .jsonl.gz files"),
                  quiet: bool = typer.Option(False, help="no progress bar")):
    """Play the recipe's tasks and label every turn from the sandbox's ground truth (oracle labels, not human)."""
    try:
        s = run_oracle_labels(load_recipe(recipe), out, tuple(p.strip() for p in policies.split(",") if p.strip()),
                              split, limit, show_progress=not quiet, compress=gzip)
    except (RecipeError, ValueError) as e:
        _fail(str(e))
    typer.echo(json.dumps({k: s[k] for k in ("tasks", "trajectories", "labels", "label_counts")}))


@app.command()
def evolve(labels: Path = typer.Option(..., "--labels", help="labels: JSONL, Argilla or Label Studio export"),
           out: Path = typer.Option(..., "--out", help="output folder: prompts/, edits.jsonl, evolution.json, "
                                                      "final_prompt.json"),
           trajectories: Optional[Path] = typer.Option(None, help="trajectory JSONL (default: trajectories.jsonl "
                                                                  "beside the labels)"),
           start: str = typer.Option("default", help="default | draft | snapshot JSON | version in --prompts"),
           prompts: Optional[Path] = typer.Option(None, help="a prompt snapshot folder to look --start up in"),
           budget: int = typer.Option(200_000, help="judge calls the loop may spend (turn judgments not cached)"),
           held_out: float = typer.Option(0.4, help="share of tasks held out to pick and report the final version"),
           tolerance: float = typer.Option(0.02, help="largest per-skill agreement drop an accepted edit may cause"),
           max_iterations: int = typer.Option(30, help="most edits to accept"),
           backend: str = typer.Option("rule", help=_BACKEND_HELP),
           model: Optional[str] = typer.Option(None, help="judge model for --backend openai"),
           proposer_model: Optional[str] = typer.Option(None, help="a chat model that proposes edits as JSON "
                                                                   "patches (default: the offline analyzer)"),
           base_url: Optional[str] = typer.Option(None, help="endpoint for the openai models"),
           api_key_env: str = typer.Option("OPENAI_API_KEY", help="environment variable that holds the key"),
           seed: int = typer.Option(0, help="seed of the validation / held-out split"),
           quiet: bool = typer.Option(False, help="no progress lines")):
    """Evolve the reward prompt against labels: Cluster, Analyzer, Refiner, Validator, rollback, held-out pick."""
    try:
        s = run_evolve(labels, out, trajectories, start, prompts, budget, held_out, seed, tolerance, max_iterations,
                       backend, model, base_url, api_key_env, proposer_model, show_progress=not quiet)
    except ValueError as e:
        _fail(str(e))
    typer.echo(json.dumps({"held_out": {"start": {k: s["held_out"][0][k] for k in ("agreement", "kappa")},
                                        "final": {k: s["final"][k] for k in ("prompt_version", "agreement",
                                                                             "kappa")}},
                           "validation": {"start": {k: s["start"][k] for k in ("agreement", "kappa")},
                                          "final": {k: s["accepted_versions"][-1][k]
                                                    for k in ("prompt_version", "agreement", "kappa")}},
                           "edits_accepted": s["edits_accepted"], "edits_tried": s["edits_tried"],
                           "judge_calls": s["judge_calls"], "stopped": s["stopped"]}))


@app.command()
def audit(labels: Path = typer.Option(..., "--labels", help="labels: JSONL, Argilla or Label Studio export"),
          prompt: str = typer.Option("default", "--prompt", help="default | draft | snapshot JSON | version or "
                                                                "hash in --prompts"),
          out: Path = typer.Option(..., "--out", help="output folder: audit.json, report.md, PNG charts"),
          trajectories: Optional[Path] = typer.Option(None, help="trajectory JSONL (default: trajectories.jsonl "
                                                                 "beside the labels)"),
          prompts: Optional[Path] = typer.Option(None, help="prompt snapshot folder (e.g. an evolve run's "
                                                            "OUT/prompts)"),
          compare: Optional[str] = typer.Option(None, help="a second prompt version: adds its agreement and a "
                                                           "McNemar test"),
          backend: str = typer.Option("rule", help=_BACKEND_HELP),
          model: Optional[str] = typer.Option(None, help="judge model for --backend openai"),
          base_url: Optional[str] = typer.Option(None, help="endpoint for --backend openai"),
          api_key_env: str = typer.Option("OPENAI_API_KEY", help="environment variable that holds the key")):
    """Audit a prompt version's judge against labels: agreement, kappa (bootstrap CI), per skill, confusion."""
    try:
        r = run_audit(labels, prompt, out, trajectories, prompts, compare, backend, model, base_url, api_key_env)
    except ValueError as e:
        _fail(str(e))
    keep = {k: r[k] for k in ("n", "agreement", "kappa", "kappa_ci", "missing", "judge_errors", "source")}
    if "compare" in r:
        c = r["compare"]
        keep["compare"] = {"agreement": c["b"]["agreement"], "kappa": c["b"]["kappa"], "mcnemar": c["mcnemar"]}
    typer.echo(json.dumps(keep))


@app.command("export-disputed")
def export_disputed(trajectories: Path = typer.Option(..., "--trajectories", help="trajectory JSONL"),
                    out: Path = typer.Option(..., "--out", help="output folder: argilla/, label_studio/"),
                    prompt: str = typer.Option("default", help="the judge's prompt version"),
                    prompts: Optional[Path] = typer.Option(None, help="prompt snapshot folder"),
                    labels: Optional[Path] = typer.Option(None, help="existing labels (a disagreement counts)"),
                    compare: Optional[str] = typer.Option(None, help="a second prompt version (a split counts)"),
                    top: int = typer.Option(100, help="how many cases to export")):
    """Export the most disputed turns to Argilla and Label Studio import formats for people to label."""
    if not trajectories.is_file():
        _fail(f"--trajectories {trajectories}: no such file")
    try:
        s = run_export_disputed(trajectories, out, prompt, prompts, labels, compare, top)
    except ValueError as e:
        _fail(str(e))
    typer.echo(json.dumps(s))


def main(argv: list[str] | None = None) -> int:
    """Run the command line on `argv` (default: this process's arguments); returns the exit code."""
    try:
        app(args=argv, prog_name="embodistill")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
