"""How well do the TextWorld teacher, the game's oracle and random play do on generated games?

    python benchmarks/textworld_eval.py                    # 8 games of each kind below, seeds from 1000
    python benchmarks/textworld_eval.py --games 30 --seed 5000

Builds games with `tw-make` (cached under `--out`, by spec), plays each with the teacher (`textworld_env.teacher`:
the objective and what the agent saw), the oracle (the game's own plan from the current state) and random
choices among the admissible commands that a skill stands for, all through the one episode loop, and prints
one JSON object: per kind (tw-simple with detailed / brief / no goal, coin collector levels 1-30, treasure hunter
levels 1-20, custom games with world size <= 8 and quest length <= 6) the won rate with its Wilson 95% interval,
mean steps and their ratio to the walkthrough's length, the invalid-call rate; seeds that admit no quest are
skipped and counted; and the env's steps per second.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def kinds(n: int, seed: int) -> dict[str, list]:
    from textworld_env.games import GameSpec
    rng = random.Random(seed)
    out: dict[str, list] = {f"simple-{g}": [GameSpec(kind="simple", goal=g, seed=seed + i) for i in range(n)]
                            for g in ("detailed", "brief", "none")}
    out["coin_collector"] = [GameSpec(kind="coin_collector", level=rng.randint(1, 30), seed=seed + i) for i in range(n)]
    out["treasure_hunter"] = [GameSpec(kind="treasure_hunter", level=rng.randint(1, 20), seed=seed + i)
                              for i in range(n)]
    custom = []
    for i in range(n):
        world = rng.randint(2, 8)
        custom.append(GameSpec(kind="custom", world_size=world, nb_objects=rng.randint(world, 2 * world + 4),
                               quest_length=rng.randint(1, 6), seed=seed + i))
    out["custom"] = custom
    return out


class RandomAgent:
    """A random admissible command that a skill stands for (the floor any policy must beat)."""

    def __init__(self, env, seed: int):
        self.env, self.rng = env, random.Random(seed)

    def act(self, info: dict):
        from textworld_env.env import call_for_command
        calls = [c for c in (call_for_command(x, self.env.belief) for x in self.env.admissible_commands()) if c]
        return "random", self.rng.choice(calls) if calls else {"name": "finish", "arguments": {}}

    def observe(self, call, info, observation) -> None:
        pass


def main() -> None:
    from agent.episode import play
    from agent.policies import ScriptedPolicy
    from evaluation.pixel_report import wilson
    from textworld_env.env import OracleAgent, TextWorldEnv
    from textworld_env.games import NoQuestError, make_game
    from textworld_env.teacher import Teacher

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--games", type=int, default=8, help="games per kind")
    ap.add_argument("--seed", type=int, default=1000, help="the first game seed")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "textworld" / "games"))
    args = ap.parse_args()

    t0 = time.time()
    games: dict[str, list[tuple]] = {}
    skipped: dict[str, int] = {}
    for kind, specs in kinds(args.games, args.seed).items():
        for spec in specs:
            try:
                games.setdefault(kind, []).append((spec, make_game(spec, args.out)))
            except NoQuestError:
                skipped[kind] = skipped.get(kind, 0) + 1
    build_s = time.time() - t0
    policies = {"teacher": lambda env, seed: Teacher(env), "oracle": lambda env, seed: OracleAgent(env),
                "random": lambda env, seed: RandomAgent(env, seed)}
    report: dict = {"benchmark": "textworld_eval", "games_per_kind": args.games, "first_seed": args.seed,
                    "build_seconds": round(build_s, 1), "no_quest_skipped": skipped, "kinds": {}}
    steps = seconds = 0.0
    for kind, items in games.items():
        row = {}
        for name, factory in policies.items():
            t = time.time()
            played = play(TextWorldEnv, ScriptedPolicy(factory, name),
                          [({"task": {"id": spec.key, "game": str(path)}}, i) for i, (spec, path) in enumerate(items)])
            seconds += time.time() - t
            trajs = played.trajectories
            steps += sum(len(x.turns) for x in trajs)
            won = sum(x.success for x in trajs)
            lo, hi = wilson(won, len(trajs))
            turns = [len(x.turns) for x in trajs]
            row[name] = {"games": len(trajs), "won": won, "won_rate": round(won / len(trajs), 4),
                         "won_wilson95": [round(lo, 4), round(hi, 4)],
                         "mean_steps": round(sum(turns) / len(trajs), 2),
                         "steps_over_walkthrough": round(sum(turns) / max(1, sum(x.optimal_steps for x in trajs)), 3),
                         "invalid_call_rate": round(sum(t.error is not None for x in trajs for t in x.turns)
                                                    / max(1, sum(turns)), 4)}
        report["kinds"][kind] = row
    teacher = [r["teacher"] for r in report["kinds"].values()]
    report["teacher_won_rate_all"] = round(sum(r["won"] for r in teacher) / sum(r["games"] for r in teacher), 4)
    report["acceptance"] = {"teacher_ge_0.95": report["teacher_won_rate_all"] >= 0.95}
    report["env_steps_per_second"] = round(steps / seconds, 1)   # whole loop, scripted policies (game + belief)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
