"""The main job: distill -> SFT -> on-policy distillation -> GiGPO RL on one recipe, then a table of what each
stage did.

    accelerate launch rl/train_gigpo.py recipes/medium.yaml        # the same as: embodistill rl recipes/medium.yaml

The RL stage starts from `rl.init`: with `sft` (this recipe's SFT checkpoint) the distillation and SFT stages
run first when their outputs are missing, each resuming what an interrupted run left, and are reused when they
exist; with `onpolicy` the on-policy distillation stage runs after them. Each stage shows one progress bar and
writes its raw logs to OUT/log.txt of its own folder.

Under several processes (`accelerate launch --num_processes N`, `torchrun`), the main process makes the
missing upstream stages alone, as a one-process run, while the others wait; then all of them train.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.console import print_tables, stage_log
from pipeline.recipe import Recipe, load_recipe
from pipeline.stages import (distill_complete, rl_init, run_distill_stage, run_onpolicy_stage, run_rl_stage,
                             run_sft_stage)
from rl.trainer import RLError

# what torchrun and accelerate set for a process group: hidden while the main process runs a stage alone
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")
UPSTREAM_FAILED = "upstream_failed.txt"


@contextmanager
def alone(threads: int | None = None) -> Iterator[None]:
    """Run a stage in this process as a one-process run on every core (or on `threads`: the recipe's
    `sft.threads`, for runs side by side), then leave no trace for the next one.

    A stage that trains (TRL's SFTTrainer) sets up accelerate's process-wide state and environment variables
    (its mixed precision among them) which the RL trainer's `Accelerator` would otherwise inherit; and
    `accelerate launch` may have set OMP_NUM_THREADS=1. So: the process-group variables are hidden and torch uses
    every core while the stage runs; afterwards the environment is restored and accelerate's state reset."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    saved, before = dict(os.environ), torch.get_num_threads()
    for key in DIST_VARS:
        os.environ.pop(key, None)
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(before)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _distill_row(recipe: Recipe, folder: Path, cached: bool, seconds: float | None = None) -> dict:
    m = _read(folder / "metrics.json")
    fmt = recipe.distill.sample_format
    rows = (m.get("rows") or {}).get(fmt, {})
    tsr = ((m.get("teacher_metrics") or {}).get("all") or {}).get("tsr")
    figures = f"{m.get('kept', '?')} of {m.get('episodes', '?')} teacher episodes kept (teacher TSR {tsr}); " \
              f"{rows.get('train', '?')} {fmt} rows for training, {rows.get('validation', '?')} for validation"
    return {"stage": "distill", "seconds": m.get("seconds") if seconds is None else seconds, "cached": cached,
            "figures": figures, "output": str(folder / "dataset")}


def _sft_row(folder: Path, cached: bool, seconds: float | None = None) -> dict:
    m = _read(folder / "metrics.json")
    if seconds is None:
        seconds = (m.get("train_seconds") or 0) + ((m.get("lm_phase") or {}).get("train_seconds") or 0) or None
    loss, eval_loss = m.get("train_loss"), m.get("eval_loss")
    if loss is None or eval_loss is None:
        figures = "a checkpoint made elsewhere (no SFT metrics beside it)"
    else:
        figures = f"{(m.get('params') or 0) / 1e6:.2f}M parameters, {m.get('steps', '?')} steps; assistant-only " \
                  f"loss {loss:.3f} (validation {eval_loss:.3f})"
    return {"stage": "sft", "seconds": seconds, "cached": cached, "figures": figures, "output": str(folder / "final")}


def _onpolicy_row(folder: Path, cached: bool, seconds: float | None = None) -> dict:
    m = _read(folder / "metrics.json")
    rounds = [r for r in m.get("rounds", []) if r.get("round", 0) > 0]
    tsr = " -> ".join(f"{r['test']['all']['tsr']:.4f}" for r in m.get("rounds", []) if "all" in r.get("test", {}))
    agree = ", ".join(f"{r['collect']['agreement']:.2f}" for r in rounds)
    figures = (f"{len(rounds)} rounds, {m.get('rows', '?')} labelled states; agreement with the teacher by round "
               f"{agree}; test TSR by round {tsr}") if rounds else "a checkpoint made elsewhere"
    return {"stage": "onpolicy", "seconds": m.get("seconds") if seconds is None else seconds, "cached": cached,
            "figures": figures, "output": str(folder / "final")}


def make_upstream(recipe: Recipe, init: Path, own: bool, quiet: bool) -> list[dict]:
    """The stages before RL, made when missing: the distilled dataset, the SFT checkpoint and, with
    `rl.init: onpolicy`, the on-policy distilled student. Returns their rows of the closing table."""
    base = Path("outputs") / recipe.name
    distill_dir, sft_dir, op_dir = base / "distill", base / "sft", base / "onpolicy"
    with_onpolicy = own and init.parent == op_dir
    if (init / "config.json").is_file():
        if not own:
            return []
        rows = [_distill_row(recipe, distill_dir, cached=True)] if (distill_dir / "metrics.json").is_file() else []
        rows.append(_sft_row(sft_dir, cached=True))
        return rows + ([_onpolicy_row(op_dir, cached=True)] if with_onpolicy else [])
    if not own:
        raise RLError(f"{init}: no model checkpoint there (no config.json). A student comes from `embodistill sft "
                      "RECIPE` (outputs/<recipe>/sft/final), `embodistill onpolicy RECIPE` (outputs/<recipe>/"
                      "onpolicy/final) or an earlier RL run (OUT/final); `rl.init: sft` or `onpolicy` makes it on "
                      "the fly")
    rows = []
    with alone(recipe.sft.threads):
        dataset = distill_dir / "dataset"
        if distill_complete(distill_dir):
            rows.append(_distill_row(recipe, distill_dir, cached=True))
        else:
            t0 = time.perf_counter()
            with stage_log(distill_dir):
                run_distill_stage(recipe, distill_dir, show_progress=not quiet)
            rows.append(_distill_row(recipe, distill_dir, cached=False, seconds=time.perf_counter() - t0))
        if with_onpolicy and (sft_dir / "manifest.json").is_file() and (sft_dir / "final" / "config.json").is_file():
            rows.append(_sft_row(sft_dir, cached=True))
        else:
            t0 = time.perf_counter()
            with stage_log(sft_dir):
                run_sft_stage(recipe, dataset, sft_dir, show_progress=not quiet)
            rows.append(_sft_row(sft_dir, cached=False, seconds=time.perf_counter() - t0))
        if with_onpolicy:
            t0 = time.perf_counter()
            with stage_log(op_dir):
                run_onpolicy_stage(recipe, dataset, sft_dir / "final", op_dir, show_progress=not quiet)
            rows.append(_onpolicy_row(op_dir, cached=False, seconds=time.perf_counter() - t0))
    return rows


def _wait_for(init: Path) -> None:
    """Another process makes the starting checkpoint: wait for it, or for its failure."""
    failed = init.parent / UPSTREAM_FAILED
    while not (init / "config.json").is_file():
        if failed.is_file():
            raise RLError(f"the main process could not make {init}: {failed.read_text()}")
        time.sleep(2)


def _evaluation_rows(summary: dict, start: dict | None = None) -> dict:
    """Per block: (episodes, TSR before RL, TSR after RL). Before RL is RL's own evaluation of its start or, with
    `rl.eval_start: false`, `start` (the on-policy stage's last evaluation of the same student) where it played
    the same number of episodes; None where neither measured it."""
    first, last = summary.get("initial_eval") or start or {}, summary.get("final_eval") or {}
    out = {}
    for block in ("easy", "medium", "hard", "all", "seen", "compositional", "pool"):
        if block in last:
            name = {"all": "test, all", "pool": "RL pool sample"}.get(block, f"test, {block}")
            same = block in first and first[block]["episodes"] == last[block]["episodes"]
            out[name] = (last[block]["episodes"], first[block]["tsr"] if same else None, last[block]["tsr"])
    return out


def _onpolicy_last_eval(recipe: Recipe, init: Path) -> dict | None:
    """The test figures of the on-policy stage's last round when RL starts from its student and both evaluated
    the whole test split."""
    if init.parent != Path("outputs") / recipe.name / "onpolicy" or recipe.onpolicy.eval_tasks is not None \
            or recipe.rl.eval_tasks is not None:
        return None
    rounds = _read(init.parent / "metrics.json").get("rounds") or []
    return rounds[-1].get("test") if rounds else None


def run_main_job(recipe_path: str | Path, init: str | Path | None = None, algorithm: str | None = None,
                 out: str | Path | None = None, seed: int | None = None, iterations: int | None = None,
                 resume: bool = False, restart: bool = False, quiet: bool = False) -> dict:
    """Make what RL starts from when missing, run RL, print the closing table (main process). Returns the RL
    run's summary (OUT/metrics.json)."""
    recipe = load_recipe(recipe_path)   # unknown or ill-typed keys fail here, before any work
    init, own = rl_init(recipe, init)
    algorithm = algorithm or recipe.rl.algorithm
    out = Path(out) if out else Path("outputs") / recipe.name / "rl" / (algorithm + ("" if seed is None
                                                                                    else f"-seed{seed}"))
    main_process = int(os.environ.get("RANK", "0")) == 0
    rows: list[dict] = []
    if main_process:
        failed = init.parent / UPSTREAM_FAILED
        failed.unlink(missing_ok=True)
        try:
            rows = make_upstream(recipe, init, own, quiet)
        except Exception as e:
            if own:
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text(str(e))
            raise
    else:
        _wait_for(init)
    t0 = time.perf_counter()
    if main_process:
        with stage_log(out):
            summary = run_rl_stage(recipe, out, init, algorithm=algorithm, seed=seed, iterations=iterations,
                                   resume=resume, restart=restart, show_progress=not quiet)
    else:
        summary = run_rl_stage(recipe, out, init, algorithm=algorithm, seed=seed, iterations=iterations,
                               resume=resume, restart=restart, show_progress=False)
    if main_process and summary:
        rows.append({"stage": f"rl ({algorithm})", "seconds": time.perf_counter() - t0, "cached": False,
                     "figures": f"{summary['iterations']} iterations, {summary['rollout_episodes']} rollout episodes; "
                                f"peak memory {summary['peak_rss_mb'] / 1024:.1f} GB; curves in "
                                f"{out / 'curves.png'}",
                     "output": summary["final"]})
        start = None if summary.get("initial_eval") else _onpolicy_last_eval(recipe, init)
        print_tables(rows, _evaluation_rows(summary, start),
                     before_note="the on-policy stage's last evaluation (rl.eval_start: false)" if start else None)
    return summary
