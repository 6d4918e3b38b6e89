"""Policies that act in the sandbox through the same interface as a model: the expert (teacher role,
belief only) and a seeded random policy (a floor for every metric)."""

from __future__ import annotations

import random

from sandbox.expert import ExpertPlanner
from sandbox.gym_env import SandboxEnv
from sandbox.skills import SKILLS


class ExpertPolicy:
    name = "expert"

    def reset(self, env: SandboxEnv, seed: int) -> None:
        self.planner = ExpertPlanner(env.ctrl, privileged=False)

    def act(self, env: SandboxEnv, observation: str) -> tuple[str, dict]:
        return self.planner.act()

    def observe(self, call, result_info: dict, observation: str) -> None:
        from sandbox.controller import StepResult
        res = StepResult(ok=result_info["error"] is None, observation=observation, error=result_info["error"])
        self.planner.observe(call, res)


def random_call(rng: random.Random, ids: list[str]) -> dict:
    """A uniformly random skill with arguments drawn from `ids` (and sometimes junk)."""
    skill = SKILLS[rng.choice(list(SKILLS))]
    args = {}
    for p in skill.params:
        if not p.required and rng.random() < 0.5:
            continue
        if p.enum:
            args[p.name] = rng.choice(p.enum)
        elif p.name in ("reason", "message", "summary", "answer", "query"):
            args[p.name] = rng.choice(ids + ["help", "something"]) if ids else "x"
        else:
            args[p.name] = rng.choice(ids) if ids and rng.random() < 0.9 else "thing"
    return {"name": skill.name, "arguments": args}


class RandomPolicy:
    """Uniform over skills, arguments drawn from ids the agent has seen (and sometimes junk)."""

    name = "random"

    def reset(self, env: SandboxEnv, seed: int) -> None:
        self.rng = random.Random(seed)

    def act(self, env: SandboxEnv, observation: str) -> tuple[str, dict]:
        known = env.known()
        ids = [p for p, _ in known["places"]] + [o for o, _, _ in known["objects"]] + \
            [f for fs in known["landmarks"].values() for f in fs] + \
            [c for c, *_ in known["connections"]] + [p for p, *_ in known["people"]]
        return "random", random_call(self.rng, ids)

    def observe(self, call, result_info: dict, observation: str) -> None:
        pass


POLICIES = {"expert": ExpertPolicy, "random": RandomPolicy}
