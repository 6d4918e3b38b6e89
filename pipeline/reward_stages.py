"""Reward-engine stages behind the CLI: judging trajectory files, oracle labels, the evolution loop, audits, export
for labelling."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from agent.clients import OpenAIClient
from agent.progress import StageBar
from agent.trajectory import Trajectory, read_jsonl, read_jsonl_lenient, write_json, write_jsonl
from pipeline.recipe import Recipe
from pipeline.stages import build_tasks
from reward_engine.audit import audit_report, write_audit
from reward_engine.evolve import (EvolutionConfig, Judging, LabelledSet, LLMProposer, evolve, select_final,
                                  split_by_task)
from reward_engine.judge import LLMBackend, RewardEngine, RuleBackend, VerdictCache, summarize, turn_line
from reward_engine.labels import case_id, export_for_labelling, read_labels, trajectory_key
from reward_engine.meta_judge import MetaJudge
from reward_engine.oracle import build_oracle_set, write_oracle_set
from reward_engine.prompt import PromptStore, default_prompt, draft_prompt, load_prompt

START_PROMPTS = ("default", "draft")


def judge_backend(backend: str = "rule", model: str | None = None, base_url: str | None = None,
                  api_key_env: str = "OPENAI_API_KEY"):
    """The turn judge: `rule` (offline) or `openai` (any OpenAI-compatible endpoint, key from the env)."""
    if backend == "rule":
        return RuleBackend()
    if backend != "openai":
        raise ValueError(f"backend must be rule or openai, not {backend!r}")
    if not model:
        raise ValueError("the openai backend needs a model name")
    return LLMBackend(OpenAIClient(model, base_url=base_url, api_key_env=api_key_env))


def run_judge(trajectories: Path, out: Path, backend: str = "rule", model: str | None = None,
              base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY", prompt_path: Path | None = None,
              cache_path: Path | None = None, show_progress: bool = True) -> dict:
    """Judge a trajectory file: bad lines are reported by line and field and skipped; the rest are judged."""
    rows, bad = read_jsonl_lenient(trajectories, Trajectory)
    prompt = load_prompt(prompt_path) if prompt_path else default_prompt()
    be = judge_backend(backend, model, base_url, api_key_env)
    engine = RewardEngine(prompt, be, VerdictCache(cache_path or out / "cache.jsonl"))
    bar = StageBar("judge", enabled=show_progress)
    bar.phase(be.id, len(rows), unit="traj")
    verdicts = []
    for _, traj in rows:
        verdicts.append(engine.score(traj))
        bar.update(1)
    bar.close()
    write_jsonl(out / "verdicts.jsonl", verdicts)
    summary = summarize(verdicts, bad)
    summary["cache"] = {"hits": engine.cache.hits, "misses": engine.cache.misses}
    if isinstance(be, LLMBackend):
        summary["llm"] = dict(be.stats)
    write_json(out / "summary.json", summary)
    PromptStore(out / "prompts").save(prompt)
    write_json(out / "manifest.json", {"stage": "judge", "trajectories": str(trajectories), "backend": be.id,
                                       "prompt_version": prompt.version, "prompt_hash": prompt.content_hash(),
                                       "trajectories_sha256": hashlib.sha256(Path(trajectories).read_bytes())
                                       .hexdigest()[:16]})
    return summary


def resolve_prompt(ref: str, store: Path | None = None):
    """`default` | `draft` | a snapshot JSON path | a version number or hash prefix in the `store` folder."""
    if ref == "default":
        return default_prompt()
    if ref == "draft":
        return draft_prompt()
    p = Path(ref)
    if p.suffix == ".json" and p.is_file():
        return load_prompt(p)
    if store is None or not Path(store).is_dir():
        raise ValueError(f"prompt {ref!r}: not default, draft or a snapshot file, and no prompt folder "
                         f"({store}) to look it up in (pass --prompts DIR, e.g. an evolve run's OUT/prompts)")
    st = PromptStore(store)
    try:
        return st.load(int(ref)) if ref.isdigit() else st.load(ref)
    except KeyError:
        have = ", ".join(f"v{v} {h}" for v, h, _ in st.versions()) or "none"
        raise ValueError(f"prompt {ref!r} is not in {store} (snapshots: {have})") from None


def load_labelled(labels: Path, trajectories: Path | None = None):
    """Labels (any supported format) joined with their trajectories (default: trajectories.jsonl beside them)."""
    if not Path(labels).exists():
        raise ValueError(f"--labels {labels}: no such file")
    recs = read_labels(labels)
    if not recs:
        raise ValueError(f"{labels}: no labels")
    if trajectories is None:
        beside = Path(labels).parent if Path(labels).is_file() else Path(labels)
        trajectories = next((beside / n for n in ("trajectories.jsonl", "trajectories.jsonl.gz")
                             if (beside / n).is_file()), beside / "trajectories.jsonl")
    trajectories = Path(trajectories)
    if not trajectories.is_file():
        raise ValueError(f"no trajectory file {trajectories} (pass --trajectories FILE)")
    trajs = list(read_jsonl(trajectories, Trajectory))
    return LabelledSet(trajs, recs)


def run_oracle_labels(recipe: Recipe, out: Path, policies: tuple[str, ...] = ("expert", "noisy", "random"),
                      split: str = "all", limit: int | None = None, show_progress: bool = True,
                      compress: bool = False) -> dict:
    """Build the recipe's tasks, play them with each policy and write trajectories + oracle labels."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be train, test or all, not {split!r}")
    if recipe.env != "sandbox":
        raise ValueError(f"recipe {recipe.name}: env: {recipe.env}: oracle labels read the sandbox's true state; "
                         "use a sandbox recipe")
    splits, _ = build_tasks(recipe, show_progress=show_progress)
    tasks = splits["train"] + splits["test"] if split == "all" else splits[split]
    tasks = tasks[:limit] if limit else tasks
    bar = tqdm(total=len(tasks), desc="oracle labels", unit="task", disable=not show_progress)
    trajs, labels = build_oracle_set(tasks, policies, seed=recipe.seed, progress=bar.update)
    bar.close()
    paths = write_oracle_set(out, trajs, labels, compress)
    summary = {"source": "oracle (computed from the sandbox's ground truth; not human labels)",
               "recipe": recipe.name, "split": split, "tasks": len(tasks), "policies": list(policies),
               "trajectories": len(trajs), "labels": len(labels),
               "label_counts": dict(sorted(Counter(lb.label for lb in labels).items())),
               "per_policy": {p: dict(sorted(Counter(lb.label for lb in labels
                                                     if lb.trajectory.split("|")[1] == p).items()))
                              for p in policies}, **paths}
    write_json(out / "summary.json", summary)
    return summary


def run_evolve(labels: Path, out: Path, trajectories: Path | None = None, start: str = "default",
               prompts: Path | None = None, budget: int = 200_000, held_out: float = 0.4, seed: int = 0,
               tolerance: float = 0.02, max_iterations: int = 30, backend: str = "rule", model: str | None = None,
               base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY", proposer_model: str | None = None,
               show_progress: bool = True) -> dict:
    """Evolve a reward prompt on the validation part of a labelled set; pick and report on the held-out part."""
    data = load_labelled(labels, trajectories)
    val, held = split_by_task(data, held_out, seed)
    if not val.labels or not held.labels:
        raise ValueError(f"the split left {len(val.labels)} validation and {len(held.labels)} held-out labels; "
                         "label more tasks or change --held-out")
    start_prompt = resolve_prompt(start, prompts)
    judging = Judging(judge_backend(backend, model, base_url, api_key_env), VerdictCache(out / "cache.jsonl"))
    proposer = None
    if proposer_model:
        proposer = LLMProposer(OpenAIClient(proposer_model, base_url=base_url, api_key_env=api_key_env), val)
    cfg = EvolutionConfig(budget=budget, tolerance=tolerance, max_iterations=max_iterations)
    say = (lambda m: tqdm.write(m)) if show_progress else None
    res = evolve(start_prompt, val, out, cfg, judging, proposer, progress=say)
    final, held_scores = select_final(res, out / "prompts", held, judging)
    PromptStore(out / "prompts").save(final)
    write_json(out / "final_prompt.json", final.model_dump(mode="json"))
    summary = {"labels": str(labels), "validation_labels": len(val.labels), "held_out_labels": len(held.labels),
               "start": res.start, "accepted_versions": [
                   {**{k: v[k] for k in ("prompt_version", "prompt_hash", "agreement", "kappa", "meta_quality")},
                    "edit": v["accepted_edit"], "motivated_by": v.get("motivated_by"), "deltas": v.get("deltas")}
                   for v in res.versions],
               "edits_tried": len(res.log), "edits_accepted": len(res.versions) - 1, "stopped": res.stopped,
               "held_out": held_scores, "final": {"prompt_version": final.version, "prompt_hash": final.content_hash(),
                                                  **next(h for h in held_scores
                                                         if h["prompt_hash"] == final.content_hash())},
               "judge_calls": {"loop": res.judge_calls, "total": judging.calls}, "budget": budget}
    write_json(out / "evolution.json", summary)
    return summary


def judged_cases(prompt, data, backend) -> dict[str, dict]:
    """case_id -> {label, rationale, prompt_version, prompt_hash} for every labelled turn."""
    eng = RewardEngine(prompt, backend)
    out = {}
    for tr in data.trajs:
        tv = eng.score(tr)
        key = trajectory_key(tr)
        for v in tv.turns:
            out[f"{key}#{v.index}"] = {"label": v.label, "rationale": v.rationale, "score": v.score,
                                       "prompt_version": prompt.version, "prompt_hash": tv.prompt_hash}
    return out


def run_audit(labels: Path, prompt: str, out: Path, trajectories: Path | None = None, prompts: Path | None = None,
              compare: str | None = None, backend: str = "rule", model: str | None = None,
              base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY", examples: int = 10) -> dict:
    """Agreement of a prompt version's judge with the labels: audit.json, report.md and PNG charts in OUT."""
    data = load_labelled(labels, trajectories)
    be = judge_backend(backend, model, base_url, api_key_env)
    pa = resolve_prompt(prompt, prompts)
    ja = judged_cases(pa, data, be)
    jb = judged_cases(resolve_prompt(compare, prompts), data, be) if compare else None
    report = audit_report(data.labels, ja, jb, examples=examples)
    report["prompt_ref"] = prompt
    if compare:
        report["compare_ref"] = compare
    title = f"Reward judge audit: prompt {prompt} (v{pa.version}, {pa.content_hash()})" + \
        (f" vs {compare}" if compare else "")
    write_audit(report, out, title)
    return report


def run_export_disputed(trajectories: Path, out: Path, prompt: str = "default", prompts: Path | None = None,
                        labels: Path | None = None, compare: str | None = None, top: int = 100) -> dict:
    """The most disputed turns, for people to label, in Argilla and Label Studio import formats.

    Dispute score per turn: 2 if the judge disagrees with an existing label, 1 per Meta-Judge dimension the
    verdict fails, 1 if the `compare` prompt version labels it differently; ties by case id."""
    trajs = list(read_jsonl(trajectories, Trajectory))
    gold = {lb.case_id: lb.label for lb in read_labels(labels)} if labels else {}
    pa = resolve_prompt(prompt, prompts)
    eng = RewardEngine(pa, RuleBackend())
    eng_b = RewardEngine(resolve_prompt(compare, prompts), RuleBackend()) if compare else None
    meta = MetaJudge()
    scored = []
    for tr in trajs:
        key = trajectory_key(tr)
        tv = eng.score(tr)
        metas = {m.turn: m for m in meta.check_trajectory(pa, tr, tv)}
        tvb = eng_b.score(tr) if eng_b else None
        for v in tv.turns:
            cid = case_id(key, v.index)
            s = len(metas[v.index].failed)
            if cid in gold and gold[cid] != v.label:
                s += 2
            if tvb is not None and tvb.turns[v.index].label != v.label:
                s += 1
            if s > 0:
                text = "\n".join([f"Task: {tr.instruction}", "", "History:",
                                  *[turn_line(tr, i) for i in range(max(0, v.index - 8), v.index)], "",
                                  "Judged turn:", turn_line(tr, v.index, full=True)])
                scored.append((-s, cid, {"case_id": cid, "trajectory": key, "turn": v.index, "skill": v.skill,
                                         "text": text, "judge_label": v.label, "judge_rationale": v.rationale}))
    scored.sort(key=lambda x: (x[0], x[1]))
    cases = [c for _, _, c in scored[:top]]
    paths = export_for_labelling(cases, out) if cases else {}
    summary = {"disputed": len(scored), "exported": len(cases), "paths": {k: str(v) for k, v in paths.items()}}
    write_json(out / "export.json", summary)
    return summary
