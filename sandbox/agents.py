"""Scripted agents for one sandbox episode: the expert (the embedded teacher) and a seeded random agent.

An agent is made when its episode starts, from the reset env and the episode seed, then asked `act(info)` for
each decision, which returns (thought, call dict); `observe(call, info, observation)` gives it the result of
the call the env read. `agent.policies.ScriptedPolicy` runs them in the episode loop.
"""

from __future__ import annotations

import random

from sandbox.expert import ExpertPlanner
from sandbox.skills import SKILLS, StepResult, same_call


class ExpertAgent:
    """The expert planner acting on the agent's belief only (never the true state): it searches, asks, fails
    and recovers, as a teacher should.

    `takeover=True`: the expert labels, or takes over, an episode another policy plays. It is asked `act` at
    every state and then told the call that was actually made; a call that is not the one it proposed counts
    as someone else's (`ExpertPlanner.observe(own=False)`): a wrong report or operation does not mark its stage
    done, and the other policy's repeated failures do not make it give up. `privileged=True` is the oracle
    (it reads the true state: for validating tasks and states, never for teaching)."""

    name = "expert"

    def __init__(self, env, seed: int = 0, takeover: bool = False, privileged: bool = False):
        if env.ctrl is None:
            raise RuntimeError("ExpertAgent: reset the env first (env.reset(options={'task': ...}))")
        self.planner = ExpertPlanner(env.ctrl, privileged=privileged)
        self.takeover = takeover
        self.proposed: dict | None = None

    def act(self, info: dict) -> tuple[str, dict]:
        thought, call = self.planner.act()
        self.proposed = call
        return thought, call

    def observe(self, call: dict | None, info: dict, observation: str) -> None:
        if call is not None:
            own = not self.takeover or same_call(call, self.proposed)
            self.planner.observe(call, StepResult(ok=info["error"] is None, observation=observation,
                                                  error=info["error"]), own=own)


class ReplayAgent:
    """Replays the calls another policy made (dicts, or the unreadable text it wrote), then hands over to
    `then`, an agent made by `then(env, seed)` at the start; `then` is asked at every replayed state and told
    each replayed call, exactly as when it labels a live episode. How an expert takes over at step t of a
    student's episode: `ReplayAgent(env, seed, calls[:t], then=lambda e, s: ExpertAgent(e, s, takeover=True))`."""

    name = "takeover"

    def __init__(self, env, seed: int, calls: list, then):
        self.calls, self.next = list(calls), then(env, seed)
        self.step = 0

    def act(self, info: dict):
        thought, call = self.next.act(info)
        if self.step < len(self.calls):
            replayed = self.calls[self.step]
            self.step += 1
            return "replayed", replayed
        return thought, call

    def observe(self, call: dict | None, info: dict, observation: str) -> None:
        self.next.observe(call, info, observation)


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
