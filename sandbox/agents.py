"""Scripted agents for one sandbox episode: the expert (the embedded teacher) and a seeded random agent.

An agent is made when its episode starts, from the reset env and the episode seed, then asked `act(info)` for
each decision, which returns (thought, call dict); `observe(call, info, observation)` gives it the result of
the call the env read. `agent.policies.ScriptedPolicy` runs them in the episode loop.
"""

from __future__ import annotations

import random

from sandbox.expert import ExpertPlanner
from sandbox.skills import SKILLS, StepResult


class ExpertAgent:
    """The expert planner acting on the agent's belief only (never the true state): it searches, asks, fails
    and recovers, as a teacher should."""

    name = "expert"

    def __init__(self, env, seed: int = 0):
        if env.ctrl is None:
            raise RuntimeError("ExpertAgent: reset the env first (env.reset(options={'task': ...}))")
        self.planner = ExpertPlanner(env.ctrl, privileged=False)

    def act(self, info: dict) -> tuple[str, dict]:
        return self.planner.act()

    def observe(self, call: dict | None, info: dict, observation: str) -> None:
        if call is not None:
            self.planner.observe(call, StepResult(ok=info["error"] is None, observation=observation,
                                                  error=info["error"]))


def known_ids(known: dict) -> list[str]:
    """Every id the agent's known map names: places, objects, landmarks, doors, people."""
    return [p for p, _ in known["places"]] + [o for o, _, _ in known["objects"]] + \
        [f for fs in known["landmarks"].values() for f in fs] + \
        [c for c, *_ in known["connections"]] + [p for p, *_ in known["people"]]


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


class RandomAgent:
    """Uniform over skills, arguments drawn from the ids the agent has seen (and sometimes junk): a floor for
    every metric."""

    name = "random"

    def __init__(self, env=None, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, info: dict) -> tuple[str, dict]:
        return "random", random_call(self.rng, known_ids(info["known"]))

    def observe(self, call: dict | None, info: dict, observation: str) -> None:
        pass
