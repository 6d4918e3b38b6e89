"""Is the expert a good teacher from any reachable state? It takes over at a random step of episodes played by
other policies and plays to the end of the task's budget; the privileged oracle does the same from the same
state (it reads the true state: the task was still solvable there iff it succeeds).

    python benchmarks/takeover.py                                   # medium recipe, 400 train tasks
    python benchmarks/takeover.py --model outputs/medium/sft/final  # also from a student's states

Prints one JSON object: per policy whose states are taken over (the noisy expert at two mistake rates, the random
agent, and a student model when given), the expert's success, the oracle's, the expert's among the states the
oracle solves (`expert_success_when_solvable`; the goal is >= 0.99) and the first cases it lost there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "medium.yaml"))
    ap.add_argument("--tasks", type=int, default=400, help="the first N train tasks")
    ap.add_argument("--model", default=None, help="a student model folder whose states are taken over too")
    ap.add_argument("--seed", type=int, default=1, help="which step of each episode is taken over")
    args = ap.parse_args()

    from agent.clients import TransformersClient
    from agent.episode import episode_seed, play
    from agent.policies import ChatPolicy, ScriptedPolicy
    from distill.onpolicy import takeover
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks
    from sandbox.agents import RandomAgent
    from sandbox.gym_env import SandboxEnv
    from sandbox.oracle import NoisyExpertAgent

    recipe = load_recipe(args.recipe)
    tasks = build_tasks(recipe, show_progress=False)[0]["train"][: args.tasks]
    by_id = {t.id: t for t in tasks}
    policies = {"noisy expert, 30% mistakes": ScriptedPolicy(lambda e, s: NoisyExpertAgent(e, s, rate=0.3), "noisy"),
                "noisy expert, 60% mistakes": ScriptedPolicy(lambda e, s: NoisyExpertAgent(e, s, rate=0.6), "noisy"),
                "random": ScriptedPolicy(RandomAgent, "random")}
    if args.model:
        policies[f"student {args.model}"] = ChatPolicy(TransformersClient(args.model, max_new_tokens=96,
                                                                          batch_size=32), name="student")
    report = {"benchmark": "takeover", "recipe": recipe.name, "tasks": len(tasks), "policies": {}}
    for name, policy in policies.items():
        t0 = time.time()
        played = play(SandboxEnv, policy, [({"task": t}, episode_seed(recipe.seed, t.id)) for t in tasks],
                      batch_size=32)
        res = takeover(SandboxEnv, played.trajectories, by_id, seed=args.seed, episodes=len(tasks))
        res["lost_when_solvable"] = res["lost_when_solvable"][:10]
        res["policy_success"] = round(sum(t.success for t in played.trajectories) / len(tasks), 4)
        res["seconds"] = round(time.time() - t0, 1)
        report["policies"][name] = res
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
