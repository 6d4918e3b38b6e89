"""Executable checks over a trajectory's recorded state history (the rule-program judge's predicates).

`History(traj)` indexes what was known before each turn: facts ever learned (`seen:ID`, `locked:ID`, ...),
the place, holdings, subgoals met, earlier calls and their results, and the state keys visited. A check
takes `(history, t)` and returns `Hit(rationale, evidence)` when it fires, else None. Checks are registered
by name in `CHECKS`; prompt components reference them by that name, so an edited prompt can only point at
code that exists here (nothing from a model is ever executed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from agent.trajectory import Trajectory, Turn

MALFORMED_ERRORS = frozenset({"bad_arguments", "missing_argument", "extra_argument", "bad_argument_type",
                              "bad_argument_value"})
# facts that show the agent met (or checked) the obstacle a help request is about
HELP_EVIDENCE = {"unlock": ("locked:{t}", "state:{t}:locked=True"), "clear": ("blocked:{t}",),
                 "permission": ("restricted:{t}",), "repair": ("broken:{t}", "state:{t}:broken=True"),
                 "carry": ("heavy:{t}", "fragile:{t}")}
OBSERVE_KINDS = frozenset({"observed", "inspected", "told"})


@dataclass(frozen=True)
class Hit:
    rationale: str
    evidence: tuple[int, ...]


def call_text(turn: Turn) -> str:
    c = turn.tool_call
    return "(unreadable)" if c is None else f"{c['name']}({json.dumps(c.get('arguments', {}), sort_keys=True)})"


class History:
    """Prefix indexes over one trajectory, built once in O(turns)."""

    def __init__(self, traj: Trajectory):
        self.traj = traj
        turns = traj.turns
        n = len(turns)
        self.known_before: list[frozenset[str]] = []   # facts ever learned before turn t
        self.place_before: list[str | None] = []
        self.holding_before: list[tuple[str, ...]] = []
        self.met_before: list[int] = []                 # subgoals met before turn t
        self.first_learned: dict[str, int] = {}         # fact -> turn that first learned it
        self.keys_before: list[frozenset[str]] = []
        known: set[str] = set()
        place = _initial_place(traj)
        holding: tuple[str, ...] = ()
        met = len(traj.initial_subgoals_met)
        keys = {traj.initial_state_key}
        for t, u in enumerate(turns):
            self.known_before.append(frozenset(known))
            self.place_before.append(place)
            self.holding_before.append(holding)
            self.met_before.append(met)
            self.keys_before.append(frozenset(keys))
            if u.state is not None:
                for f in u.state.learned:
                    if f not in known:
                        known.add(f)
                        self.first_learned[f] = t
                place, holding = u.state.place, tuple(u.state.holding)
            met += len(u.subgoals_met)
            keys.add(u.state_key)
        self.met_total = met
        self.n = n
        self.sg_kind = [g.kind for g in traj.subgoals]

    def prev_key(self, t: int) -> str:
        return self.traj.initial_state_key if t == 0 else self.traj.turns[t - 1].state_key

    def learned(self, t: int) -> list[str]:
        u = self.traj.turns[t]
        return [f for f in (u.state.learned if u.state else []) if self.first_learned.get(f) == t]

    def mentions(self, t: int, eid: str) -> bool:
        """Did an earlier turn's call or result name this id (a failure on it, an inspection of it)?"""
        for s in range(t):
            u = self.traj.turns[s]
            args = (u.tool_call or {}).get("arguments") or {}
            if eid in args.values() or f"[{eid}]" in u.observation:
                return True
        return False


def _initial_place(traj: Trajectory) -> str | None:
    obs = traj.initial_observation
    if obs.startswith("You are in the ") and "[" in obs:
        return obs.split("[", 1)[1].split("]", 1)[0]
    return None


def _args(u: Turn) -> dict:
    return (u.tool_call or {}).get("arguments") or {}


def _name(u: Turn) -> str | None:
    return (u.tool_call or {}).get("name")


# --------------------------------------------------------------------------- verifiable checks


def unreadable(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.tool_call is None or u.error == "parse_error":
        return Hit("the output has no readable tool call", (t,))
    return None


def invalid_tool(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error == "unknown_tool":
        return Hit(f"{_name(u)!r} is not a skill", (t,))
    return None


def bad_arguments(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error in MALFORMED_ERRORS:
        return Hit(f"malformed arguments ({u.error}): {u.observation[:80]}", (t,))
    return None


def after_end(h: History, t: int) -> Hit | None:
    if h.traj.turns[t].error == "episode_over":
        return Hit("the call comes after the episode ended", (t,))
    return None


def unknown_entity(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error == "unknown_entity":
        return Hit(f"{call_text(u)} names an id the agent has not seen", (t,))
    return None


# --------------------------------------------------------------------------- semantic checks (rule program)


def blind_retry(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error is None or u.tool_call is None:
        return None
    for s in range(t - 1, -1, -1):
        p = h.traj.turns[s]
        if p.tool_call == u.tool_call and p.error is not None:
            # "busy, ask again" refusals invite the very same question once more
            if p.error == "refused" and "again" in p.observation:
                return None
            if p.error == u.error and p.observation == u.observation:
                return Hit(f"{call_text(u)} failed at turn {s} the same way and was repeated unchanged", (s, t))
            return None
    return None


def no_effect(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error is not None or _name(u) in ("report", "finish", None):
        return None
    if u.state_key == h.prev_key(t) and not u.subgoals_met:
        return Hit(f"{call_text(u)} changed nothing (same state, no new facts)", (t,))
    return None


def revisit(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.state_key != h.prev_key(t) and u.state_key in h.keys_before[t]:
        for s in range(t):
            if h.traj.turns[s].state_key == u.state_key:
                return Hit(f"the agent is back in the state of turn {s}", (s, t))
        return Hit("the agent is back in its initial state", (t,))
    return None


def uninformative_failure(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error in ("precondition_unmet", "unreachable") and not h.learned(t) and u.trigger is None:
        return Hit(f"{call_text(u)} failed ({u.observation[:80]}) and revealed nothing new", (t,))
    return None


def known_constraint(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if u.error is None:
        return None
    known = h.known_before[t]
    a = _args(u)
    if _name(u) == "navigate" and "restricted area" in u.observation:
        for f in sorted(known):
            if f.startswith("restricted:") and ("permit:" + f[11:]) not in known:
                return Hit(f"{call_text(u)} heads into {f[11:]}, known to be restricted", (h.first_learned[f], t))
    if _name(u) == "pick_up" and ("fragile:" + a.get("object", "")) in known and h.holding_before[t]:
        f = "fragile:" + a["object"]
        return Hit(f"{call_text(u)} lifts a known fragile object with full hands", (h.first_learned[f], t))
    return None


def already_there(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if _name(u) == "navigate" and _args(u).get("target") == h.place_before[t] and h.place_before[t] is not None:
        return Hit(f"the agent is already in {h.place_before[t]}", (t,))
    return None


def known_blocked(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if _name(u) == "navigate" and u.error == "unreachable" and "already found" in u.observation:
        return Hit("every known route is blocked by an obstacle the agent already found", (t,))
    return None


def repeat_search(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if _name(u) != "search" or u.state is None:
        return None
    fact = f"searched:{h.place_before[t]}:"
    q = str(_args(u).get("query", "")).strip().lower()
    for f in h.known_before[t]:
        if f.startswith(fact) and f[len(fact):] == q:
            return Hit(f"{call_text(u)} repeats the search of turn {h.first_learned[f]}", (h.first_learned[f], t))
    return None


def known_locked(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    target = _args(u).get("target", "")
    if _name(u) == "open" and u.error is not None and ("locked:" + target in h.known_before[t] or
                                                       f"state:{target}:locked=True" in h.known_before[t]):
        f = "locked:" + target if "locked:" + target in h.first_learned else f"state:{target}:locked=True"
        return Hit(f"{call_text(u)}: {target} was known to be locked", (h.first_learned.get(f, t), t))
    return None


def repeat_question(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if _name(u) != "talk_to":
        return None
    a = _args(u)
    for s in range(t):
        p = h.traj.turns[s]
        pa = _args(p)
        if _name(p) == "talk_to" and p.error is None and pa.get("person") == a.get("person") and \
                pa.get("topic") == a.get("topic"):
            return Hit(f"{a.get('person')} already answered about {a.get('topic')} at turn {s}", (s, t))
    return None


def unasked_report(h: History, t: int) -> Hit | None:
    if _name(h.traj.turns[t]) == "report" and h.sg_kind and "reported" not in h.sg_kind:
        return Hit("the task asks for no report", (t,))
    return None


# --------------------------------------------------------------------------- temporal preconditions


def report_before_observe(h: History, t: int) -> Hit | None:
    """The first unmet subgoal is one of observing (seeing, inspecting, being told): the report skips it."""
    u = h.traj.turns[t]
    if _name(u) != "report" or u.error is not None:
        return None
    k = h.met_before[t]
    if h.sg_kind:
        if k < len(h.sg_kind) and h.sg_kind[k] in OBSERVE_KINDS:
            return Hit(f"the report comes before the target was observed (subgoal {k} "
                       f"'{h.traj.subgoals[k].description}' unmet)", (t,))
        return None
    # no subgoal record: fall back to any observation of something
    if not any(f.startswith(("seen:", "inspected:", "told", "state:")) for f in h.known_before[t]):
        return Hit("the report comes before anything was observed", (t,))
    return None


def help_before_obstacle(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if _name(u) != "ask_for_help":
        return None
    a = _args(u)
    req, target = a.get("request", ""), a.get("target", "")
    known = h.known_before[t]
    if req == "locate":
        if any(f.startswith("searched:") for f in known) or h.mentions(t, target):
            return None
        return Hit(f"asked where {target} is without searching first", (t,))
    facts = [p.format(t=target) for p in HELP_EVIDENCE.get(req, ())]
    if any(f in known for f in facts):
        return None
    # a failed attempt on the target also counts as meeting the obstacle
    for s in range(t):
        p = h.traj.turns[s]
        if p.error is not None and target and (target in _args(p).values() or f"[{target}]" in p.observation
                                               or target in p.observation):
            return None
    return Hit(f"asked to {req} {target} without meeting or checking that obstacle first", (t,))


def finish_before_done(h: History, t: int) -> Hit | None:
    u = h.traj.turns[t]
    if _name(u) != "finish" or u.error is not None:
        return None
    total = h.traj.subgoals_total or len(h.sg_kind)
    met = h.met_before[t] + len(u.subgoals_met)
    if met < total:
        return Hit(f"finished with {met}/{total} subgoals met", (t,))
    return None


CHECKS: dict[str, Callable[[History, int], Hit | None]] = {f.__name__: f for f in (
    unreadable, invalid_tool, bad_arguments, after_end, unknown_entity, blind_retry, no_effect, revisit,
    uninformative_failure, known_constraint, already_there, known_blocked, repeat_search, known_locked,
    repeat_question, unasked_report, report_before_observe, help_before_obstacle, finish_before_done)}

# checks about what only the sandbox has (people to ask and answer, reports, help requests, permits and fragile
# objects, searches for a named thing, obstacles it reports as found): an env without them (TextWorld) drops them
# from the reward prompt (`RewardPrompt.without_checks`); the others hold for any env behind the env contract
SANDBOX_ONLY = frozenset({"known_constraint", "known_blocked", "repeat_search", "repeat_question", "unasked_report",
                          "report_before_observe", "help_before_obstacle"})
