"""How well do the TextWorld teacher, the game's oracle, random play and students do on generated games?

    python benchmarks/textworld_eval.py                    # 8 games of each kind below, seeds from 1000
    python benchmarks/textworld_eval.py --games 30 --seed 5000
    python benchmarks/textworld_eval.py --student zero-shot=outputs/medium/rl/final   # a student as another row
    python benchmarks/textworld_eval.py --kinds cooking --games 20 --constrained --student sft=DIR   # cooking only

Builds games as `tw-make` does (one `Maker` process, cached under `--out` by spec) and evaluates each policy on all
of them with `evaluation.textworld.evaluate_textworld` (the one episode loop): the teacher (`textworld_env.teacher`:
the objective and what the agent saw), the oracle (the game's own plan from the current state), random choices among
the admissible commands that a skill stands for, and any `--student` model folders. Prints one JSON object: per kind
(tw-simple with detailed / brief / no goal, coin collector levels 1-30, treasure hunter levels 1-20, custom
games with world size <= 8 and quest length <= 6; cooking games of 1-3 ingredients only with `--kinds cooking`)
and policy the games won with a Wilson 95% interval, the score ratio, steps and their ratio to the walkthrough's
length, the invalid-call and loop rates; seeds that admit no quest are skipped and counted; and the env's steps
per second (env time only). `--constrained`: students decode as `recipes/textworld.yaml` evaluates them.
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
    # cooking: verbs no navigation skill covers (slice, dice, cook, prepare, eat) go through `operate`
    out["cooking"] = [GameSpec(kind="cooking", recipe=rng.randint(1, 3), seed=seed + i) for i in range(n)]
    return out


def main() -> None:
    from evaluation.textworld import evaluate_textworld
    from textworld_env.games import Maker, NoQuestError, make_game

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--games", type=int, default=8, help="games per kind")
    ap.add_argument("--seed", type=int, default=1000, help="the first game seed")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "textworld" / "games"))
    ap.add_argument("--student", action="append", default=[], metavar="NAME=PATH",
                    help="also evaluate a model folder as row NAME (repeatable): sft=..., onpolicy=..., gigpo=..., "
                         "zero-shot=... (a sandbox-trained student)")
    ap.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                    help="only these kinds (default: all but cooking, which is reported on its own: --kinds cooking)")
    ap.add_argument("--constrained", action="store_true",
                    help="students decode constrained (agent.constrained), as recipes/textworld.yaml evaluates them")
    ap.add_argument("--eval-out", default=None, help="where each policy's evaluation folder goes (default: a "
                                                     "folder beside --out named eval-SEED-GAMES)")
    args = ap.parse_args()
    students = dict(x.split("=", 1) for x in args.student)

    t0 = time.time()
    games, skipped = [], {}
    table = kinds(args.games, args.seed)
    wanted = args.kinds or [k for k in table if k != "cooking"]
    unknown = sorted(set(wanted) - set(table))
    if unknown:
        ap.error(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(table)})")
    with Maker() as maker:                   # one TextWorld process for every game
        for kind, specs in ((k, table[k]) for k in wanted):
            for spec in specs:
                try:
                    games.append(make_game(spec, args.out, maker))
                except NoQuestError:
                    skipped[kind] = skipped.get(kind, 0) + 1
    build_s = time.time() - t0
    eval_out = Path(args.eval_out or Path(args.out).parent / f"eval-{args.seed}-{args.games}")
    report: dict = {"benchmark": "textworld_eval", "games_per_kind": args.games, "first_seed": args.seed,
                    "kinds_asked": wanted, "students_constrained": args.constrained,
                    "games": len(games), "build_seconds": round(build_s, 1), "no_quest_skipped": skipped,
                    "kinds": {}, "all": {}}
    steps_per_s = {}
    for name, policy in {"teacher": "expert", "oracle": "oracle", "random": "random", **students}.items():
        m = evaluate_textworld(games, policy, eval_out / name, seed=0,
                               constrained=args.constrained and name in students)
        for kind, block in m["by_type"].items():
            report["kinds"].setdefault(kind, {})[name] = block
        report["all"][name] = m["all"]
        steps_per_s[name] = m["env_steps_per_second"]
    report["teacher_won_rate_all"] = report["all"]["teacher"]["won_rate"]
    report["acceptance"] = {"teacher_ge_0.95": report["teacher_won_rate_all"] >= 0.95}
    report["env_steps_per_second"] = steps_per_s   # env time only (game + belief), per policy
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
