"""Evaluate any policy on TextWorld games: ours (`textworld_env.games`) or any folder a user made with `tw-make`.

    embodistill eval recipes/tiny.yaml --env textworld:outputs/textworld/games --policy expert --out outputs/tw-eval

    from evaluation.textworld import evaluate_textworld
    metrics = evaluate_textworld("my_games/", "outputs/textworld/onpolicy/final", Path("outputs/tw-eval"))

A game is a `.z8` or `.ulx` file with the `.json` tw-make writes beside it (the env reads the game's facts and
admissible commands from it). Every policy plays through the one episode loop: `expert` (the teacher of
`textworld_env.teacher`: the objective and what the agent saw), `oracle` (the game's own plan from the current
state), `random` (a random admissible command that a skill stands for), or a model folder (greedy).

Writes OUT/metrics.json (per game type, per type and level, and over all: games won with a Wilson 95% interval,
the score ratio, steps, steps over the walkthrough's length on won games, the invalid-call rate, the loop rate),
OUT/trajectories.jsonl, OUT/report.md and, last, OUT/manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from agent.clients import TransformersClient
from agent.episode import episode_seed, play
from agent.metrics import DEADLOCK_K, has_loop, trajectories_deadlock_report
from agent.policies import ChatPolicy, ScriptedPolicy
from agent.tools import tool_definitions
from agent.trajectory import Trajectory, write_json, write_jsonl, write_text_atomic
from evaluation.pixel_report import wilson

GAME_SUFFIXES = (".z8", ".ulx")
SCRIPTED = ("expert", "oracle", "random")
_KINDS = ("simple", "coin_collector", "treasure_hunter", "cooking")


class GameFolderError(ValueError):
    """A game path that holds no playable game; the message names the path and what is missing."""


def find_games(path: str | Path) -> list[Path]:
    """The games at `path` (a game file, or a folder searched recursively), sorted; each has its `.json`."""
    path = Path(path)
    if path.is_file():
        games = [path]
    elif path.is_dir():
        # a hidden file or folder (a build in progress: `textworld_env.games` builds in `.KEY-*/`) is no game
        games = sorted(p for p in path.rglob("*") if p.suffix in GAME_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        raise GameFolderError(f"{path}: no such game file or folder")
    if not games:
        raise GameFolderError(f"{path}: no TextWorld game (.z8 or .ulx) in it; make some with "
                              "`tw-make custom --world-size 4 --nb-objects 6 --quest-length 3 --output DIR/game.z8`")
    bad = [g for g in games if g.suffix not in GAME_SUFFIXES]
    if bad:
        raise GameFolderError(f"{bad[0]}: not a TextWorld game (.z8 or .ulx)")
    missing = [g for g in games if not g.with_suffix(".json").is_file()]
    if missing:
        raise GameFolderError(f"{missing[0]}: no {missing[0].with_suffix('.json').name} beside it (tw-make writes "
                              f"one with each game; the env reads the game's facts from it); {len(missing)} of "
                              f"{len(games)} games lack theirs")
    return games


def game_type(game: Path) -> tuple[str, int | None]:
    """(type, level) of a game: from the spec `textworld_env.games` saved beside it (tw-simple by its goal text:
    `simple-brief`), else from the uuid tw-make wrote into its `.json` (`tw-coin_collector-...`); a game of no known
    type is `custom`, with no level."""
    spec = game.with_suffix(".spec.json")
    if spec.is_file():
        s = json.loads(spec.read_text())
        return (f"simple-{s['goal']}" if s["kind"] == "simple" else s["kind"]), s.get("level")
    try:
        uuid = json.loads(game.with_suffix(".json").read_text()).get("metadata", {}).get("uuid", "")
    except (OSError, ValueError) as e:
        raise GameFolderError(f"{game.with_suffix('.json')}: not readable JSON ({e})") from None
    kind = next((k for k in _KINDS if uuid.startswith(f"tw-{k}-")), "custom")
    return kind, None


def make_policy(policy: str, constrained: bool = False, max_new_tokens: int = 96):
    """expert | oracle | random | a model folder (greedy, with TextWorld's `operate` actions in its tools)."""
    from textworld_env.env import OPERATE_VERBS, OracleAgent, RandomAgent
    from textworld_env.teacher import Teacher
    scripted = {"expert": Teacher, "oracle": OracleAgent, "random": RandomAgent}
    if policy in scripted:
        return ScriptedPolicy(scripted[policy], name=policy)
    if not (Path(policy) / "config.json").is_file():
        raise ValueError(f"unknown policy {policy!r}: choose {', '.join(SCRIPTED)} or a model folder (config.json)")
    client = TransformersClient(policy, max_new_tokens=max_new_tokens, constrained=constrained)
    return ChatPolicy(client, name=Path(policy).name, tools=tool_definitions(OPERATE_VERBS))


def _block(trajs: list[Trajectory]) -> dict:
    """The metrics of a group of games."""
    n = len(trajs)
    won = sum(t.success for t in trajs)
    steps = sum(len(t.turns) for t in trajs)
    ratios = [len(t.turns) / t.optimal_steps for t in trajs if t.success and t.optimal_steps]
    lo, hi = wilson(won, n)
    return {"games": n, "won": won, "won_rate": round(won / n, 4) if n else 0.0,
            "won_wilson95": [round(lo, 4), round(hi, 4)],
            "score_ratio": round(sum(t.subgoals_met / t.subgoals_total for t in trajs if t.subgoals_total) / n, 4)
            if n else 0.0,
            "mean_steps": round(steps / n, 2) if n else 0.0,
            "steps_over_walkthrough": round(sum(ratios) / len(ratios), 3) if ratios else None,
            "invalid_call_rate": round(sum(u.error is not None for t in trajs for u in t.turns) / steps, 4)
            if steps else 0.0,
            "loop_rate": round(sum(has_loop(t) for t in trajs) / n, 4) if n else 0.0}


def textworld_metrics(trajs: list[Trajectory], types: dict[str, tuple[str, int | None]],
                      deadlock_k: int = DEADLOCK_K) -> dict:
    """Per type, per type and level (`coin_collector/5`), and `all`; `types`: task id -> (type, level);
    `deadlock_k`: the deadlock window (calls)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        kind, level = types[t.task_id]
        groups.setdefault(kind, []).append(t)
        if level is not None:
            groups.setdefault(f"{kind}/{level}", []).append(t)
    levels = sorted((k for k in groups if "/" in k), key=lambda k: (k.split("/")[0], int(k.split("/")[1])))
    return {"all": _block(trajs), "by_type": {k: _block(groups[k]) for k in sorted(groups) if "/" not in k},
            "by_level": {k: _block(groups[k]) for k in levels},
            "deadlocks": trajectories_deadlock_report(trajs, deadlock_k)}


def evaluate_textworld(games: str | Path | list[Path], policy: str, out: Path, seed: int = 0,
                       progress: Callable[[int], None] | None = None, batch_size: int = 16,
                       constrained: bool = False, deadlock_hint: bool = False, instructions: str = "goal",
                       deadlock_k: int = DEADLOCK_K) -> dict:
    """Play every game once with `policy` and write OUT/ (see the module docstring); returns the metrics.
    `deadlock_k`: the deadlock window, calls in a row that leave the game's state as it was (default
    `agent.metrics.DEADLOCK_K`); `deadlock_hint`: the deadlock intervention (`agent.episode.hint_text` after
    that many). `instructions`: the task line a model reads, goal | step | visual (`agent.instructions`:
    the step procedure is the walkthrough's; the scripted policies act on the game, not on a task line)."""
    from textworld_env.env import TextWorldEnv
    paths = games if isinstance(games, list) else find_games(games)
    ids = [p.stem for p in paths]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise GameFolderError(f"two games are named {dup!r}; a game's file name is its id in the report")
    types = {p.stem: game_type(p) for p in paths}
    t0 = time.time()
    played = play(TextWorldEnv, make_policy(policy, constrained),
                  [({"task": {"id": p.stem, "game": str(p), "difficulty": types[p.stem][0]}},
                    episode_seed(seed, p.stem)) for p in paths],
                  batch_size=batch_size, on_done=(lambda i, e: progress(1)) if progress else None,
                  deadlock_hint=deadlock_k if deadlock_hint else None, instructions=instructions)
    seconds = time.time() - t0
    trajs = played.trajectories
    metrics = {"env": "textworld", "policy": policy, "games": len(trajs), "seed": seed,
               **textworld_metrics(trajs, types, deadlock_k), "seconds": round(seconds, 1),
               "env_steps_per_second": round(sum(len(t.turns) for t in trajs) / max(played.env_seconds, 1e-9), 1)}
    metrics["deadlocks"]["hint"] = deadlock_hint
    metrics["instructions"] = instructions
    if policy not in SCRIPTED:
        metrics["constrained_decoding"] = constrained
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "trajectories.jsonl", trajs)
    write_json(out / "metrics.json", metrics)
    write_text_atomic(out / "report.md", report(metrics))
    write_json(out / "manifest.json", {"stage": "eval", "env": "textworld", "policy": policy,
                                       "games_sha256": hashlib.sha256(json.dumps(
                                           [str(p) for p in paths]).encode()).hexdigest()[:16]})
    return metrics


def report(m: dict) -> str:
    """A Markdown table of the metrics, one row per game type, then per type and level."""
    lines = [f"# {m['policy']} on {m['games']} TextWorld games", "",
             "| games | won | 95% interval | score ratio | steps | steps / walkthrough (won) | invalid calls | loops |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    rows = [("all", m["all"])] + list(m["by_type"].items()) + list(m["by_level"].items())
    for name, b in rows:
        ratio = "-" if b["steps_over_walkthrough"] is None else f"{b['steps_over_walkthrough']:.2f}"
        lines.append(f"| {name} ({b['games']}) | {b['won_rate']:.3f} | {b['won_wilson95'][0]:.3f}-"
                     f"{b['won_wilson95'][1]:.3f} | {b['score_ratio']:.3f} | {b['mean_steps']:.1f} | {ratio} | "
                     f"{b['invalid_call_rate']:.3f} | {b['loop_rate']:.3f} |")
    d = m["deadlocks"]
    lines += ["", f"Deadlocks ({d['k']} calls in a row with no change of the game's state): {d['deadlocks']} in "
              f"{d['episodes_with_deadlock']} games; aware {d['aware']}, unaware {d['unaware']}, recovered "
              f"{d['recovered']}; failed games with an aware one {d['failed_with_aware']}, with an unaware one "
              f"{d['failed_with_unaware']}; phi(deadlock, failure) {d['phi_deadlock_failure']}."]
    return "\n".join(lines) + "\n"
