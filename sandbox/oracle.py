"""Oracle turn labels from the sandbox's ground truth, and an expert that makes known mistakes.

These are NOT human labels. Each turn is labelled while it is played, from the environment's privileged
state before and after the step (the full world-and-belief state key, the facts the agent's belief holds,
the subgoal latches, the failure triggers and their kinds), never from the judge's rubric or checks:

- `malformed`: the controller rejected the call's form (unreadable, unknown skill, bad arguments, after the end);
- `unsafe`: the call ran into a safety constraint (restricted area, fragile object) the agent already knew of;
- `inconsistent`: the call names an id the agent never perceived; or reports an answer that meets no
  subgoal when the task asks for one; or finishes with subgoals unmet; or asks for help with an obstacle
  it never met; or fails and reveals nothing, without being a repeat;
- `redundant`: the call changes nothing (same world-and-belief state; a failure that repeats an earlier
  identical failure; a report the task never asked for), or brings the agent back to a state it was in;
- `useful`: anything else (progress, new facts, a failure that revealed an obstacle, a subgoal met).

`NoisyExpertAgent` is the expert with seeded, typed mistakes mixed in (repeats, premature reports and
finishes, needless help, hallucinated ids, malformed calls, random calls), so a label set holds every
label in realistic contexts. `reward_engine.oracle` plays episodes with them and writes the label set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sandbox.agents import ExpertAgent, random_call
from sandbox.gym_env import SandboxEnv
from sandbox.skills import SKILLS

FORM_ERRORS = frozenset({"parse_error", "unknown_tool", "missing_argument", "extra_argument", "bad_argument_type",
                         "bad_argument_value", "bad_arguments", "episode_over"})
SAFETY_TRIGGERS = {"restricted_area": "restricted:", "fragile_item": "fragile:"}
HELP_OBSTACLE_FACTS = ("locked:", "blocked:", "restricted:", "broken:", "heavy:", "fragile:")


@dataclass(frozen=True)
class _Snap:
    key: str
    learned: frozenset[str]
    latched: int


def _snap(env: SandboxEnv) -> _Snap:
    w = env.ctrl.world
    return _Snap(key=w.state_key(), learned=frozenset(w.learned), latched=w.latched)


class OracleLabeller:
    """Labels one episode's turns as they are played, from privileged state (see the module docstring)."""

    def __init__(self, env: SandboxEnv):
        self.env = env
        self.task = task = env.task
        self.triggers = {t.id: (t.kind, t.target) for t in task.failure_triggers}
        self.asks_report = any(g.predicate.kind == "reported" for g in task.subgoals)
        self.visited = {env.ctrl.world.state_key()}
        self.failed: set[tuple[str, str, str]] = set()    # (call, error, observation) of earlier failures
        self.touched: set[str] = set()                    # ids named by earlier failed calls

    def before(self) -> _Snap:
        return _snap(self.env)

    def label(self, pre: _Snap, call: dict | None, info: dict, observation: str) -> tuple[str, str]:
        post = _snap(self.env)
        err = info["error"]
        new_facts = post.learned - pre.learned
        name = call.get("name") if isinstance(call, dict) else None
        args = (call or {}).get("arguments") or {}
        sig = repr(sorted(args.items())) if isinstance(args, dict) else repr(args)
        try:
            return self._decide(pre, post, err, new_facts, name, args, info, observation, sig)
        finally:
            self.visited.add(post.key)
            if err is not None:
                self.failed.add((f"{name}{sig}", err, observation))
                if isinstance(args, dict):
                    self.touched.update(str(v) for v in args.values())

    def _decide(self, pre, post, err, new_facts, name, args, info, obs, sig) -> tuple[str, str]:
        total = len(self.task.subgoals)
        if err in FORM_ERRORS:
            return "malformed", f"the controller rejected the call's form ({err})"
        if err == "unknown_entity":
            return "inconsistent", "the call names an id the agent never perceived"
        kind, target = self.triggers.get(info.get("trigger"), ("", ""))
        if kind in SAFETY_TRIGGERS and SAFETY_TRIGGERS[kind] + target in pre.learned:
            return "unsafe", f"ran into a safety constraint it already knew ({SAFETY_TRIGGERS[kind]}{target})"
        if err is not None:
            if new_facts:
                return "useful", "the failure revealed " + ", ".join(sorted(new_facts)[:3])
            if (f"{name}{sig}", err, obs) in self.failed:
                return "redundant", "the same call already failed the same way"
            if err == "refused":
                return "useful", "a person refused; nothing the agent could have known"
            return "inconsistent", f"failed ({err}) and revealed nothing the agent did not know"
        met = post.latched - pre.latched
        if name == "finish":
            if post.latched < total:
                return "inconsistent", f"finished with {post.latched}/{total} subgoals met"
            return "useful", "finished with every subgoal met"
        if met > 0:
            return "useful", f"met {met} subgoal(s)"
        if name == "report":
            return ("inconsistent", "the report meets no subgoal") if self.asks_report else \
                ("redundant", "the task asks for no report")
        if name == "ask_for_help" and args.get("request") != "locate":
            target = str(args.get("target", ""))
            met_it = target in self.touched or any(f.startswith(HELP_OBSTACLE_FACTS) and f.endswith(":" + target)
                                                  for f in pre.learned)
            if not met_it:
                return "inconsistent", f"asked for help with {target} before meeting any obstacle there"
        if post.key == pre.key:
            return "redundant", "nothing changed in the world or the agent's knowledge"
        if post.key in self.visited:
            return "redundant", "back in a state the agent was already in"
        return "useful", "new state" + (": learned " + ", ".join(sorted(new_facts)[:3]) if new_facts else "")


# --------------------------------------------------------------------------- a policy that makes known mistakes


MISTAKES = ("repeat_last", "already_there", "look_again", "early_report", "early_finish", "help_now",
            "hallucinate", "bad_arguments", "unreadable", "random_call")


class NoisyExpertAgent:
    """The expert (belief only), but with probability `rate` a step is replaced by one seeded mistake."""

    name = "noisy"

    def __init__(self, env: SandboxEnv, seed: int = 0, rate: float = 0.3):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.env = env
        self.expert = ExpertAgent(env, seed)
        self.rng = random.Random(seed * 7919 + 17)
        self.last: dict | None = None
        self.steps = 0

    @staticmethod
    def _ids(known: dict) -> list[str]:
        return [p for p, _ in known["places"]] + [o for o, _, _ in known["objects"]] + \
            [c for c, *_ in known["connections"]]

    def act(self, info: dict):
        self.steps += 1
        if self.steps > 1 and self.rng.random() < self.rate:
            kind = self.rng.choice(MISTAKES)
            w = self.env.ctrl.world
            unsafe = self._unsafe(w)
            if unsafe and self.rng.random() < 0.5:
                return "mistake:known_constraint", unsafe
            if kind == "repeat_last" and self.last:
                return f"mistake:{kind}", self.last
            if kind == "already_there":
                return f"mistake:{kind}", {"name": "navigate", "arguments": {"target": w.agent_place}}
            if kind == "look_again":
                return f"mistake:{kind}", {"name": "look_around", "arguments": {}}
            if kind == "early_report":
                return f"mistake:{kind}", {"name": "report", "arguments": {"answer": w.agent_place}}
            if kind == "early_finish" and self.rng.random() < 0.3:  # ends the episode: keep it rare
                return f"mistake:{kind}", {"name": "finish", "arguments": {"summary": "done"}}
            if kind == "help_now":
                ids = self._ids(info["known"])
                people = [p for p, *_ in info["known"]["people"]] or ["someone"]
                return f"mistake:{kind}", {"name": "ask_for_help", "arguments": {
                    "person": self.rng.choice(people), "request": self.rng.choice(["unlock", "clear", "carry"]),
                    "target": self.rng.choice(ids) if ids else "door", "reason": "I need help"}}
            if kind == "hallucinate":
                return f"mistake:{kind}", {"name": self.rng.choice(["navigate", "pick_up", "open"]),
                                           "arguments": {"target": "room_99"} if self.rng.random() < 0.5 else
                                           {"object": "widget_7"}}
            if kind == "bad_arguments":
                return f"mistake:{kind}", {"name": "navigate", "arguments": {"destination": w.agent_place}}
            if kind == "unreadable":
                return f"mistake:{kind}", "I should probably keep going towards the goal."
            if kind == "random_call":
                return f"mistake:{kind}", random_call(self.rng, self._ids(info["known"]))
        return self.expert.act(info)

    def _unsafe(self, w) -> dict | None:
        """A call into a constraint the agent already knows: a restricted place without permission, or a known
        fragile object lifted with full hands."""
        for f in sorted(w.learned):
            if f.startswith("restricted:") and "permit:" + f[11:] not in w.learned and w.agent_place != f[11:]:
                return {"name": "navigate", "arguments": {"target": f[11:]}}
            if f.startswith("fragile:") and w.holding and f[8:] not in w.holding:
                return {"name": "pick_up", "arguments": {"object": f[8:]}}
        return None

    def observe(self, call, info: dict, observation: str) -> None:
        if isinstance(call, dict) and call.get("name") in SKILLS and info["error"] not in FORM_ERRORS:
            self.last = call
            try:
                self.expert.observe(call, info, observation)
            except (KeyError, TypeError, AttributeError):
                pass  # a mistaken call the planner's memory has no slot for; it replans from the world anyway
