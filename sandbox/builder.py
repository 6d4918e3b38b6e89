"""Builder: an instruction becomes Easy, Medium and Hard TaskInstances, each validated.

The default builder is procedural: it samples a layout from a scene pack (which optional connections
exist, where items are, where people stand, where the agent starts), an instruction over that layout,
then one clean (Easy) instance and obstacle-laden variants (Medium: one recoverable obstacle; Hard:
several, nested, with a helper who is busy until asked twice). Every instance is validated
(`validate_instance`) and rejected with a reason rather than emitted unsolvable. Other builders (the LLM
builder of the reward-engine-core issue) implement `InstanceBuilder` and go through the same validation.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from pydantic import ValidationError

from sandbox.controller import EnvController
from sandbox.expert import solve
from sandbox.schema import (
    DIFFICULTIES, FailureTrigger, GoalStep, ObjectRef, SceneConnection, ScenePack, Subgoal, TaskInstance,
)
from sandbox.skills import described_id
from sandbox.world import Compiled, World

# ----------------------------------------------------------------------------- configuration


@dataclass
class BuildConfig:
    seed: int = 0
    budget_factor: float = 3.0
    budget_slack: int = 16
    max_budget: int = 150
    max_attempts: int = 10         # layouts/obstacle draws tried per instruction and difficulty
    hard_min_triggers: int = 2


@dataclass
class BuildStats:
    total: int = 0
    accepted: int = 0
    rejected_reasons: Counter = field(default_factory=Counter)
    by_difficulty: dict = field(default_factory=lambda: {d: {"accepted": 0, "rejected": 0} for d in DIFFICULTIES})
    expert_solved: int = 0

    def reject(self, difficulty: str, reason: str) -> None:
        self.total += 1
        self.rejected_reasons[reason] += 1
        self.by_difficulty[difficulty]["rejected"] += 1

    def accept(self, difficulty: str, teacher_solved: bool) -> None:
        self.total += 1
        self.accepted += 1
        self.by_difficulty[difficulty]["accepted"] += 1
        self.expert_solved += int(teacher_solved)

    def to_json(self) -> dict:
        return {"total": self.total, "accepted": self.accepted, "rejected": self.total - self.accepted,
                "rejected_reasons": dict(sorted(self.rejected_reasons.items())),
                "by_difficulty": self.by_difficulty,
                "expert_solved": round(self.expert_solved / self.accepted, 4) if self.accepted else 0.0}


class InstanceBuilder(Protocol):
    def build(self, instruction_seed: int, split: str) -> list[TaskInstance]: ...


# ----------------------------------------------------------------------------- layouts


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _slug(s: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in s.lower()).strip("_")


def scene_connection_id(scene: ScenePack, sc: SceneConnection) -> str:
    """The id a scene connection gets in every layout (BabyAI doors carry their colour)."""
    if scene.vocabulary == "babyai" and sc.color:
        return f"{_slug(sc.color)}_{sc.kind}_{sc.a}_{sc.b}"
    return f"{sc.kind}_{sc.a}_{sc.b}"


def sample_layout(scene: ScenePack, rng: random.Random) -> dict:
    """A concrete env_state dict (no obstacles yet) plus bookkeeping for the instruction sampler."""
    while True:
        conns = []
        for i, sc in enumerate(scene.connections):
            if sc.optional and rng.random() < 0.5:
                continue
            cid = scene_connection_id(scene, sc)
            door = None
            if sc.kind in ("door", "gate"):
                door = "closed" if rng.random() < 0.6 else "open"
            conns.append({"id": cid, "a": sc.a, "b": sc.b, "kind": sc.kind, "door": door, "color": sc.color,
                          "_spec": i})
        # keep the graph connected
        adj: dict[str, set] = {p.id: set() for p in scene.places}
        for c in conns:
            adj[c["a"]].add(c["b"])
            adj[c["b"]].add(c["a"])
        seen, todo = {scene.places[0].id}, [scene.places[0].id]
        while todo:
            for n in adj[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        if len(seen) == len(scene.places):
            break
    objects = []
    for f in scene.fixtures:
        objects.append({"id": f.id, "type": f.type, "name": f.name, "location": f.place, "portable": False,
                        "container": f.container, "surface": f.surface, "openable": f.openable,
                        "open": f.openable and rng.random() < 0.3, "device": f.device,
                        "on": f.device and rng.random() < 0.3, "details": dict(f.details), "size": "large"})
    counts: Counter = Counter()
    kinds = list(scene.items)
    rng.shuffle(kinds)
    if scene.vocabulary == "babyai":
        n_items = rng.randint(4, 7)
        chosen = [rng.choice(kinds) for _ in range(n_items)]
    else:
        chosen = kinds[: max(3, min(len(kinds), rng.randint(4, 7)))]
    used_colors: dict[str, set] = {}
    for it in chosen:
        colors = [c for c in it.colors if c not in used_colors.get(it.type, set())] or it.colors or [None]
        color = rng.choice(colors) if colors else None
        if color is not None:
            used_colors.setdefault(it.type, set()).add(color)
        counts[it.type] += 1
        oid = (described_id(color, it.type, {o["id"] for o in objects}) if scene.vocabulary == "babyai"
               else f"{it.type}_{counts[it.type]}")
        name = f"{color} {it.name}" if color and (scene.vocabulary == "babyai" or rng.random() < 0.7) else it.name
        if scene.vocabulary == "babyai":
            name = f"{color} {it.name}"
        objects.append({"id": oid, "type": it.type, "name": name, "color": color, "size": it.size,
                        "location": rng.choice(it.spawn), "_item": it.type})
    people = []
    for p in scene.people:
        people.append({"id": p.id, "name": p.name, "role": p.role, "place": rng.choice(p.places)})
    start = rng.choice(scene.start_places)
    env = {"places": [{"id": p.id, "name": p.name, "kind": p.kind, "floor": p.floor} for p in scene.places],
           "connections": conns, "objects": objects,
           "agent": {"place": start, "holding": [], "capacity": 2},
           "people": people, "facts": [], "locks_visible": scene.locks_visible}
    layout_id = _h({"scene": scene.id, "c": [c["id"] for c in conns],
                    "o": [(o["id"], o["location"], o.get("color")) for o in objects],
                    "p": [(p["id"], p["place"]) for p in people], "s": start})
    return {"env": env, "layout_id": layout_id}


# ----------------------------------------------------------------------------- instructions


@dataclass
class Draft:
    kind: str
    text: str
    goal: list[GoalStep]
    subgoals: list[Subgoal]
    success: list
    on_map: set[str]            # item ids the map shows (with a last-known position)
    off_map: set[str]           # item ids the map must not show
    target: str | None = None   # main object


_STATE_WORDS = {"on": ("on", "off"), "open": ("open", "closed")}


def _sg(i: int, desc: str, pred: dict) -> Subgoal:
    return Subgoal.model_validate({"id": f"sg{i}", "description": desc, "predicate": pred})


def _items(env: dict) -> list[dict]:
    return [o for o in env["objects"] if o.get("portable", True) and "_item" in o]


def _place_of(env: dict, loc: str) -> str:
    objs = {o["id"]: o for o in env["objects"]}
    while loc in objs:
        loc = objs[loc]["location"]
    return loc


def _pname(env: dict, pid: str) -> str:
    return next(p["name"] for p in env["places"] if p["id"] == pid)


def sample_instruction(scene: ScenePack, env: dict, rng: random.Random, kind: str) -> Draft | None:
    items = _items(env)
    places = [p for p in env["places"]]
    place_ids = [p["id"] for p in places]
    start = env["agent"]["place"]
    fixtures = [o for o in env["objects"] if "_item" not in o]
    babyai = scene.vocabulary == "babyai"
    by_type = Counter(o["type"] for o in items)

    def ref(o: dict, owner: str | None = None) -> ObjectRef:
        color = o.get("color") if (babyai or by_type[o["type"]] > 1) else None
        return ObjectRef(type=o["type"], color=color, owner=owner)

    if kind == "navigation":
        if babyai:
            o = rng.choice(items)
            return Draft(kind, f"Go to the {o['name']}.", [GoalStep(op="go_to", object=ref(o))],
                         [_sg(0, f"stand next to the {o['name']}", {"kind": "agent_near", "object": o["id"]})],
                         [], on_map=set(), off_map={o["id"]}, target=o["id"])
        cands = [p for p in place_ids if p != start]
        p = rng.choice(cands)
        return Draft(kind, f"Go to the {_pname(env, p)}.", [GoalStep(op="go_to", place=p)],
                     [_sg(0, f"reach the {_pname(env, p)}", {"kind": "agent_at", "place": p})],
                     [{"kind": "agent_at", "place": p}], on_map=set(), off_map=set())
    if kind == "object_search":
        o = rng.choice(items)
        where = "which room it is in" if babyai else "where it is"
        p = _place_of(env, o["location"])
        return Draft(kind, f"Find the {o['name']} and report {where}.", [GoalStep(op="find_report", object=ref(o))],
                     [_sg(0, f"see the {o['name']}", {"kind": "observed", "object": o["id"]}),
                      _sg(1, f"report that it is in the {_pname(env, p)}",
                          {"kind": "reported", "value": p, "aliases": [_pname(env, p)]})],
                     [], on_map=set(), off_map={o["id"]}, target=o["id"])
    if kind == "state_inspection":
        cands = [f for f in fixtures if f.get("device") or f.get("openable")]
        if not cands:
            return None
        f = rng.choice(cands)
        attr = "on" if f.get("device") else "open"
        val = bool(f.get(attr))
        word, other = _STATE_WORDS[attr] if val else _STATE_WORDS[attr][::-1]
        pn = _pname(env, f["location"])
        return Draft(kind, f"Check whether the {f['name']} in the {pn} is {attr} and report it.",
                     [GoalStep(op="inspect_report", object=ObjectRef(type=f["type"], id=f["id"]), attribute=attr)],
                     [_sg(0, f"inspect the {f['name']}", {"kind": "inspected", "object": f["id"]}),
                      _sg(1, f"report that it is {word}",
                          {"kind": "reported", "value": word, "excludes": [other]})],
                     [], on_map=set(), off_map=set(), target=f["id"])
    if kind == "operate":
        cands = [f for f in fixtures if f.get("device") and not f.get("on")]
        if not cands:
            return None
        f = rng.choice(cands)
        pn = _pname(env, f["location"])
        return Draft(kind, f"Turn on the {f['name']} in the {pn}.",
                     [GoalStep(op="operate", object=ObjectRef(type=f["type"], id=f["id"]), action="turn_on")],
                     [_sg(0, f"turn on the {f['name']}", {"kind": "object_state", "object": f["id"],
                                                          "field": "on", "value": True})],
                     [{"kind": "object_state", "object": f["id"], "field": "on", "value": True}],
                     on_map=set(), off_map=set())
    if kind == "ask_person":
        facts = [f for f in scene.facts if f.holders]
        if not facts:
            return None
        sf = rng.choice(facts)
        answer = rng.choice(sf.answers)
        holder = rng.choice(sf.holders)
        env["facts"].append({"id": sf.id, "question": sf.question, "answer": answer})
        pname = next(p["name"] for p in env["people"] if p["id"] == holder)
        return Draft(kind, f"Ask {pname} {sf.question} and report the answer.",
                     [GoalStep(op="ask_report", person=holder, fact=sf.id)],
                     [_sg(0, f"learn {sf.question} from {pname}", {"kind": "told", "fact": sf.id}),
                      _sg(1, "report the answer", {"kind": "reported", "value": answer})],
                     [], on_map=set(), off_map=set())
    if kind == "fetch_place":
        o = rng.choice(items)
        here = _place_of(env, o["location"])
        owner = None
        it = next(i for i in scene.items if i.type == o["type"])
        if it.owned and env["people"] and not babyai:
            owner = rng.choice(env["people"])["id"]
            o["owner"] = owner
        owner_name = next((p["name"] for p in env["people"] if p["id"] == owner), None)
        what = f"{owner_name}'s {it.name}" if owner \
            else o["name"]
        if babyai:
            others = [x for x in items if x["id"] != o["id"]]
            if others and rng.random() < 0.6:
                x = rng.choice(others)
                return Draft(kind, f"Put the {o['name']} next to the {x['name']}.",
                             [GoalStep(op="fetch", object=ref(o), next_to=ref(x))],
                             [_sg(0, f"pick up the {o['name']}", {"kind": "holding", "object": o["id"]}),
                              _sg(1, f"put it next to the {x['name']}",
                                  {"kind": "next_to", "object": o["id"], "other": x["id"]})],
                             [{"kind": "next_to", "object": o["id"], "other": x["id"]}],
                             on_map=set(), off_map={o["id"], x["id"]}, target=o["id"])
            return Draft(kind, f"Pick up the {o['name']}.", [GoalStep(op="fetch", object=ref(o))],
                         [_sg(0, f"pick up the {o['name']}", {"kind": "holding", "object": o["id"]})],
                         [{"kind": "holding", "object": o["id"]}], on_map=set(), off_map={o["id"]}, target=o["id"])
        dest_fix = [f for f in fixtures if (f.get("surface") or f.get("container")) and
                    _place_of(env, f["location"]) != here]
        if dest_fix and rng.random() < 0.5:
            f = rng.choice(dest_fix)
            prep = "on" if f.get("surface") else "in"
            step = GoalStep(op="fetch", object=ref(o, owner), container=f["id"])
            text = f"Put {what if owner else 'the ' + what} {prep} the {f['name']}."
            return Draft(kind, text, [step],
                         [_sg(0, f"find the {o['name']}", {"kind": "observed", "object": o["id"]}),
                          _sg(1, f"put it {prep} the {f['name']}",
                              {"kind": "object_at", "object": o["id"], "location": f["id"]})],
                         [{"kind": "object_at", "object": o["id"], "location": f["id"]}],
                         on_map={o["id"]}, off_map=set(), target=o["id"])
        dests = [p for p in place_ids if p != here]
        p = rng.choice(dests)
        text = f"Bring {what if owner else 'the ' + what} to the {_pname(env, p)}."
        return Draft(kind, text, [GoalStep(op="fetch", object=ref(o, owner), place=p)],
                     [_sg(0, f"find the {o['name']}", {"kind": "observed", "object": o["id"]}),
                      _sg(1, f"put it in the {_pname(env, p)}", {"kind": "object_at", "object": o["id"],
                                                                 "location": p})],
                     [{"kind": "object_at", "object": o["id"], "location": p}],
                     on_map={o["id"]}, off_map=set(), target=o["id"])
    if kind == "multi_stage":
        first = sample_instruction(scene, env, rng, "fetch_place")
        second_kind = "navigation" if babyai else rng.choice(["operate", "navigation"])
        second = sample_instruction(scene, env, rng, second_kind)
        if first is None or second is None or (second.target and second.target in
                                               first.on_map | first.off_map | {first.target}):
            return None
        sgs = [Subgoal(id=f"sg{i}", description=s.description, predicate=s.predicate)
               for i, s in enumerate(first.subgoals + second.subgoals)]
        text = first.text.rstrip(".") + ", then " + second.text[0].lower() + second.text[1:]
        return Draft(kind, text, first.goal + second.goal, sgs, first.success + second.success,
                     on_map=first.on_map | second.on_map, off_map=first.off_map | second.off_map,
                     target=first.target)
    raise ValueError(f"unknown instruction kind {kind!r}")


INSTRUCTION_KINDS = ("navigation", "object_search", "state_inspection", "fetch_place", "ask_person", "operate",
                     "multi_stage")


# ----------------------------------------------------------------------------- personas and the map


def make_personas(scene: ScenePack, env: dict, rng: random.Random) -> list[dict]:
    out = []
    objs = {o["id"]: o for o in env["objects"]}
    for sp in scene.people:
        person = next(p for p in env["people"] if p["id"] == sp.id)
        knowledge = {}
        for o in _items(env):   # people know where things near them are
            p = _place_of(env, o["location"])
            if p in sp.places or rng.random() < 0.25:
                loc = o["location"]
                where = f"in the {_pname(env, p)}" if loc == p else \
                    f"{'on' if objs[loc].get('surface') else 'in'} the {objs[loc]['name']} in the {_pname(env, p)}"
                knowledge[o["id"]] = f"The {o['name']} is {where}."
        for f in env["facts"]:
            sf = next((x for x in scene.facts if x.id == f["id"]), None)
            if sf and sp.id in sf.holders:
                knowledge[f["id"]] = f"{f['question'][0].upper() + f['question'][1:]}? {f['answer']}."
        policy = [{"request": r, "requires_reason": rng.random() < 0.4, "once": False, "requires_nearby": True}
                  for r in sp.capabilities]
        out.append({"person": person["id"], "role": sp.role, "style": sp.style,
                    "capabilities": list(sp.capabilities), "knowledge": knowledge, "reveals": {},
                    "policy": policy, "busy_until_asked": 0})
    return out


def make_view(env: dict, on_map: set[str], off_map: set[str], rng: random.Random, stale: dict[str, str]) -> dict:
    hidden = {p["id"] for p in env["places"] if p.get("hidden")} | \
        {c["id"] for c in env["connections"] if c.get("hidden")}
    fixtures = [o for o in env["objects"] if "_item" not in o]
    places = []
    for p in env["places"]:
        if p["id"] in hidden:
            continue
        places.append({"id": p["id"], "name": p["name"], "kind": p["kind"], "floor": p["floor"],
                       "landmarks": [f["id"] for f in fixtures if f["location"] == p["id"]]})
    conns = []
    for c in env["connections"]:
        if c["id"] in hidden:
            continue
        door = c["door"]
        if door == "locked" and not env["locks_visible"]:
            door = "closed"
        conns.append({"id": c["id"], "a": c["a"], "b": c["b"], "kind": c["kind"], "door": door, "color": c["color"]})
    objects = []
    for f in fixtures:
        if _place_of(env, f["location"]) in hidden:
            continue
        objects.append({"id": f["id"], "name": f["name"], "type": f["type"], "color": None,
                        "last_seen": f["location"]})
    for o in _items(env):
        if o["id"] in off_map or o["id"] in env["agent"]["holding"]:
            continue
        if o["id"] in on_map or o.get("_key") or rng.random() < 0.4:
            loc = stale.get(o["id"], o["location"])
            if _place_of(env, loc) in hidden:
                continue
            objects.append({"id": o["id"], "name": o["name"], "type": o["type"], "color": o.get("color"),
                            "last_seen": loc})
    people = [{"id": p["id"], "name": p["name"], "role": p["role"], "last_seen": p["place"]} for p in env["people"]]
    return {"places": places, "connections": conns, "objects": objects, "people": people}


# ----------------------------------------------------------------------------- obstacles


def _strip(env: dict) -> dict:
    """The env_state dict without builder bookkeeping keys."""
    out = json.loads(json.dumps(env))
    for c in out["connections"]:
        c.pop("_spec", None)
    for o in out["objects"]:
        o.pop("_item", None)
        o.pop("_key", None)
    return out


class Candidate:
    """A candidate instance under construction: env, personas, triggers, map bookkeeping."""

    def __init__(self, scene: ScenePack, env: dict, draft: Draft, rng: random.Random):
        self.scene, self.env, self.draft, self.rng = scene, json.loads(json.dumps(env)), draft, rng
        self.personas = make_personas(scene, self.env, rng)
        self.triggers: list[dict] = []
        self.on_map, self.off_map = set(draft.on_map), set(draft.off_map)
        self.stale: dict[str, str] = {}

    # graph helpers over the dict env
    def _adj(self, skip: set[str] = frozenset()) -> dict[str, list[tuple[str, str]]]:
        adj: dict[str, list] = {p["id"]: [] for p in self.env["places"]}
        for c in self.env["connections"]:
            if c["id"] in skip or c.get("blocked") or c["door"] == "locked":
                continue
            adj[c["a"]].append((c["id"], c["b"]))
            adj[c["b"]].append((c["id"], c["a"]))
        return adj

    def reachable(self, skip: set[str] = frozenset(), avoid_places: set[str] = frozenset()) -> set[str]:
        adj = self._adj(skip)
        start = self.env["agent"]["place"]
        seen, todo = {start}, [start]
        while todo:
            for _, n in adj[todo.pop()]:
                if n not in seen and n not in avoid_places and not self._restricted(n):
                    seen.add(n)
                    todo.append(n)
        return seen

    def _restricted(self, pid: str) -> bool:
        return any(p["id"] == pid and p.get("restricted") for p in self.env["places"])

    def conn(self, cid: str) -> dict:
        return next(c for c in self.env["connections"] if c["id"] == cid)

    def obj(self, oid: str) -> dict:
        return next(o for o in self.env["objects"] if o["id"] == oid)

    def helper(self, request: str, reach: set[str], exclude: set[str] = frozenset()) -> str | None:
        ok = [h["person"] for h in self.personas if request in h["capabilities"] and h["person"] not in exclude
              and next(p["place"] for p in self.env["people"] if p["id"] == h["person"]) in reach]
        return self.rng.choice(sorted(ok)) if ok else None

    def add(self, kind: str, target: str, skills: list[str], condition: str, effect: str, recovery: list[str],
            candidates: list[str] | None = None) -> None:
        self.triggers.append({"id": f"t{len(self.triggers)}_{kind}", "kind": kind, "target": target,
                              "skills": skills, "condition": condition, "effect": effect, "recovery": recovery,
                              "candidates": candidates or []})

    # ------------------------------------------------------------ each obstacle kind

    def apply(self, kind: str, trace: dict) -> bool:
        """Add one obstacle of this kind if the task allows it; otherwise leave the cand unchanged."""
        saved = json.dumps([self.env, self.personas, self.triggers, sorted(self.on_map), sorted(self.off_map),
                            self.stale])
        if getattr(self, "_" + kind)(trace):
            return True
        env, personas, triggers, on_map, off_map, stale = json.loads(saved)
        self.env, self.personas, self.triggers, self.stale = env, personas, triggers, stale
        self.on_map, self.off_map = set(on_map), set(off_map)
        return False

    def _locked_door(self, trace) -> bool:
        specs = self.scene.connections
        cands = [c for c in trace["crossed"] if specs[self.conn(c)["_spec"]].lockable
                 and self.conn(c)["door"] is not None and self.conn(c)["door"] != "locked"
                 and not self.conn(c).get("hidden")]
        if not cands:
            return False
        cid = self.rng.choice(sorted(set(cands)))
        c = self.conn(cid)
        c["door"] = "locked"
        reach = self.reachable(skip={cid})
        use_key = self.scene.vocabulary == "babyai" or self.rng.random() < 0.6
        if use_key:
            spots = sorted(reach - {p["id"] for p in self.env["places"] if p.get("hidden")})
            if not spots:
                return False
            spot = self.rng.choice(spots)
            taken = {o["id"] for o in self.env["objects"]}
            kid = next(f"key_{i}" for i in range(1, 100) if f"key_{i}" not in taken)
            if self.scene.vocabulary == "babyai":
                name, color = f"{c['color']} key", c["color"]
                if any(o["type"] == "key" and o.get("color") == color for o in self.env["objects"]):
                    return False  # a second key of that colour would make the instruction ambiguous
                kid = described_id(color, "key", taken)
            else:
                other = c["b"] if c["a"] in reach else c["a"]
                name, color = f"key to the {_pname(self.env, other)} {c['kind']}", None
            self.env["objects"].append({"id": kid, "type": "key", "name": name, "color": color, "size": "small",
                                        "location": spot, "opens": cid, "_item": "key", "_key": True})
            self.on_map.add(kid)
            recovery = [f"pick up {kid} and open {cid}"]
            helper = self.helper("unlock", reach)
            if helper:
                recovery.append(f"ask_for_help({helper}, unlock, {cid})")
        else:
            helper = self.helper("unlock", reach)
            if not helper:
                return False
            recovery = [f"ask_for_help({helper}, unlock, {cid})"]
        self.add("locked_door", cid, ["navigate", "open"], f"going through {cid} while it is locked",
                 "the move stops before the door", recovery)
        return True

    def _blocked_path(self, trace) -> bool:
        specs = self.scene.connections
        cands = sorted({c for c in trace["crossed"] if specs[self.conn(c)["_spec"]].blockable})
        if not cands:
            return False
        cid = self.rng.choice(cands)
        c = self.conn(cid)
        c["blocked"] = True
        reach = self.reachable()
        recovery = []
        if c["a"] in reach and c["b"] in reach:
            recovery.append("detour by another route")
        helper = self.helper("clear", reach)
        if helper:
            recovery.append(f"ask_for_help({helper}, clear, {cid})")
        if not recovery:
            return False
        self.add("blocked_path", cid, ["navigate"], f"going through {cid}", "the move stops before it", recovery)
        return True

    def _restricted_area(self, trace) -> bool:
        start = self.env["agent"]["place"]
        specs = {p.id: p for p in self.scene.places}
        cands = sorted({p for p in trace["entered"] if specs[p].can_restrict and p != start})
        if not cands:
            return False
        pid = self.rng.choice(cands)
        place = next(p for p in self.env["places"] if p["id"] == pid)
        place["restricted"] = True
        helper = self.helper("permission", self.reachable())
        if not helper:
            return False
        self.add("restricted_area", pid, ["navigate"], f"entering {pid} without permission",
                 "entry is refused", [f"ask_for_help({helper}, permission, {pid}) with a reason"])
        return True

    def _device_malfunction(self, trace) -> bool:
        if not trace["operated"]:
            return False
        did = trace["operated"][0]
        self.obj(did)["broken"] = True
        helper = self.helper("repair", self.reachable())
        if not helper:
            return False
        self.add("device_malfunction", did, ["operate"], f"turning on {did}", "it shows an error and stays off",
                 [f"ask_for_help({helper}, repair, {did}) then operate again"])
        return True

    def _item_ok(self, oid: str, flag: str) -> bool:
        o = self.obj(oid)
        it = next((i for i in self.scene.items if i.type == o.get("_item")), None)
        return bool(it and getattr(it, flag))

    def _too_heavy(self, trace) -> bool:
        cands = [o for o in trace["picked"] if o == self.draft.target and self._item_ok(o, "can_be_heavy")]
        if not cands or not any(g.op == "fetch" and (g.place or g.container) for g in self.draft.goal):
            return False
        oid = cands[0]
        self.obj(oid)["heavy"] = True
        helper = self.helper("carry", self.reachable())
        if not helper:
            return False
        self.add("too_heavy", oid, ["pick_up"], f"lifting {oid}", "it will not budge",
                 [f"ask_for_help({helper}, carry, {oid}, destination)"])
        return True

    def _fragile_item(self, trace) -> bool:
        cands = [o for o in trace["picked"] if o == self.draft.target and self._item_ok(o, "can_be_fragile")]
        if not cands:
            return False
        oid = cands[0]
        self.obj(oid)["fragile"] = True
        start = self.env["agent"]["place"]
        taken = {o["id"] for o in self.env["objects"]}
        nid = next(f"notebook_{i}" for i in range(1, 100) if f"notebook_{i}" not in taken)
        self.env["objects"].append({"id": nid, "type": "notebook", "name": "notebook", "size": "small",
                                    "location": start, "_item": "notebook"})
        self.env["agent"]["holding"] = [nid]
        self.add("fragile_item", oid, ["pick_up"], f"picking up {oid} while holding something",
                 "the agent refuses to risk dropping it", ["put the held notebook down, then pick it up"])
        return True

    def _destination_places(self) -> set[str]:
        """Where the instruction wants things taken: an obstacle must not move the target there already."""
        out = set()
        for g in self.draft.goal:
            if g.op == "fetch":
                if g.place:
                    out.add(g.place)
                if g.container:
                    out.add(_place_of(self.env, g.container))
        return out

    def _target_taken(self) -> bool:
        """At most one of moved / hidden / look-alike per target: they would undo each other."""
        return any(t["kind"] in ("object_moved", "person_knowledge", "ambiguous_target") for t in self.triggers)

    def _object_moved(self, trace) -> bool:
        oid = self.draft.target
        if self._target_taken():
            return False
        if not oid or oid not in self.on_map or oid not in trace["picked"]:
            return False
        o = self.obj(oid)
        it = next(i for i in self.scene.items if i.type == o["_item"])
        old_place = _place_of(self.env, o["location"])
        reach = self.reachable()
        avoid = self._destination_places() | {old_place}
        spots = [s for s in it.spawn if _place_of(self.env, s) not in avoid and _place_of(self.env, s) in reach]
        spots += [p for p in sorted(reach) if p not in avoid and self.scene.vocabulary == "babyai"]
        if not spots:
            return False
        self.stale[oid] = o["location"]
        o["location"] = self.rng.choice(sorted(set(spots)))
        recovery = ["search nearby places"]
        for h in self.personas:  # whoever is near its new place knows
            person = next(p for p in self.env["people"] if p["id"] == h["person"])
            if person["place"] == _place_of(self.env, o["location"]) or self.rng.random() < 0.5:
                loc = o["location"]
                h["knowledge"][oid] = f"I saw the {o['name']} in the {_pname(self.env, _place_of(self.env, loc))}."
                recovery.append(f"talk_to({h['person']}, {oid})")
        self.add("object_moved", oid, ["navigate", "pick_up", "inspect"], f"looking for {oid} where it was last seen",
                 "it is not there", recovery)
        return True

    def _ambiguous_target(self, trace) -> bool:
        goal = next((g for g in self.draft.goal if g.object and g.object.owner), None)
        if self._target_taken():
            return False
        if goal is None or self.draft.target is None:
            return False
        o = self.obj(self.draft.target)
        owner = goal.object.owner
        o["owner"] = owner
        others = [p["id"] for p in self.env["people"] if p["id"] != owner]
        it = next(i for i in self.scene.items if i.type == o["_item"])
        colors = [c for c in it.colors if c != o.get("color")] or ["plain"]
        color = self.rng.choice(colors)
        n = len([x for x in self.env["objects"] if x["type"] == o["type"]]) + 1
        twin_id = (described_id(color, o["type"], {x["id"] for x in self.env["objects"]})
                   if self.scene.vocabulary == "babyai" else f"{o['type']}_{n}")
        twin = {"id": twin_id, "type": o["type"], "name": f"{color} {it.name}", "color": color,
                "size": o.get("size", "small"), "location": o["location"], "_item": o["_item"],
                "owner": self.rng.choice(others) if others else None}
        self.env["objects"].append(twin)
        if o["id"] in self.on_map:
            self.on_map.add(twin["id"])
        else:
            self.off_map.add(twin["id"])
        for h in self.personas:
            if h["person"] == owner:
                h["knowledge"][o["id"]] = f"Mine is the {o['name']} [{o['id']}]."
        self.add("ambiguous_target", o["id"], ["pick_up"], "picking up either look-alike before telling them apart",
                 "the agent cannot tell which one is meant",
                 [f"inspect the name tags of {o['id']} and {twin['id']}", f"talk_to({owner}, {o['type']})"],
                 candidates=sorted([o["id"], twin["id"]]))
        return True

    def _person_knowledge(self, trace) -> bool:
        oid = self.draft.target
        spots = [p for p in self.scene.places if p.hidden_spot]
        if self._target_taken():
            return False
        if not oid or not spots or oid not in trace["picked"] + trace["observed"]:
            return False
        if self.obj(oid).get("portable") is False:
            return False
        spot = spots[0].id
        if spot in self._destination_places():
            return False
        links = [c for c in self.env["connections"] if spot in (c["a"], c["b"])]
        if not links or any(c["door"] == "locked" or c.get("blocked") for c in links):
            return False
        o = self.obj(oid)
        if _place_of(self.env, o["location"]) == spot:
            return False
        o["location"] = spot
        next(p for p in self.env["places"] if p["id"] == spot)["hidden"] = True
        for c in links:
            c["hidden"] = True
        self.on_map.discard(oid)
        self.off_map.add(oid)
        reach = self.reachable()
        knowers = [h for h in self.personas if next(p["place"] for p in self.env["people"]
                                                    if p["id"] == h["person"]) in reach]
        if not knowers:
            return False
        h = self.rng.choice(knowers)
        via = links[0]
        nb = via["b"] if via["a"] == spot else via["a"]
        h["knowledge"][oid] = (f"The {o['name']} is in the {_pname(self.env, spot)} [{spot}], through the door "
                               f"from the {_pname(self.env, nb)}.")
        h["reveals"][oid] = [spot] + [c["id"] for c in links]
        for other in self.personas:
            if other is not h:
                other["knowledge"].pop(oid, None)
        self.add("person_knowledge", oid, ["search", "navigate"], f"looking for {oid} without asking",
                 "it is in a place that is not on the map", [f"talk_to({h['person']}, {o['type']})"])
        return True

    def _person_busy(self, trace) -> bool:
        asked = [p for p in trace["asked"]]
        if not asked:
            return False
        pid = asked[0]
        h = next(x for x in self.personas if x["person"] == pid)
        h["busy_until_asked"] = 1
        # the only person who can help: others lose the capabilities this person was asked for
        for req in trace["requests"].get(pid, []):
            for other in self.personas:
                if other is not h and req in other["capabilities"]:
                    other["capabilities"].remove(req)
                    other["policy"] = [r for r in other["policy"] if r["request"] != req]
        for t in self.triggers:  # keep recorded recoveries true: drop help from those who lost the capability
            t["recovery"] = [r for r in t["recovery"] if not any(
                f"ask_for_help({o['person']}, {req}," in r for o in self.personas if o is not h
                for req in trace["requests"].get(pid, []))]
        self.add("person_busy", pid, ["talk_to", "ask_for_help"], f"the first request to {pid}",
                 "they are busy and refuse", [f"ask {pid} again"])
        return True

    # ------------------------------------------------------------ finish

    def instance(self, task_id: str, instruction_id: str, difficulty: str, layout_id: str, split: str, seed: int,
                 budget: int = 500, optimal: int = 1) -> TaskInstance:
        env = _strip(self.env)
        subgoals = [s.model_dump() for s in self.draft.subgoals]
        for s in subgoals:  # a search report names where the object really is, after any obstacle moved it
            p = s["predicate"]
            if p["kind"] == "reported" and self.draft.kind in ("object_search",) and self.draft.target:
                place = _place_of(self.env, self.obj(self.draft.target)["location"])
                p["value"], p["aliases"] = place, [_pname(self.env, place)]
        view = make_view(self.env, self.on_map, self.off_map, random.Random(seed), self.stale)
        data = {"id": task_id, "instruction_id": instruction_id, "instruction": self.draft.text,
                "kind": self.draft.kind, "difficulty": difficulty, "scene": self.scene.id, "layout_id": layout_id,
                "split": split, "env_state": env, "failure_triggers": self.triggers, "human_persona": self.personas,
                "goal": [g.model_dump() for g in self.draft.goal],
                "subgoals": subgoals,
                "success": self.draft.success, "agent_view": view, "step_budget": budget,
                "optimal_steps": optimal, "seed": seed}
        return TaskInstance.model_validate(data)


# ----------------------------------------------------------------------------- validation


def resolve_trigger(w: World, t: FailureTrigger) -> None:
    """Neutralise one obstacle in a world (validation counterfactuals)."""
    k, x = t.kind, t.target
    c = w.c
    if k == "locked_door":
        w.door[x] = "closed"
    elif k == "blocked_path":
        w.blocked[x] = False
    elif k == "restricted_area":
        w.restricted[x] = False
    elif k == "device_malfunction":
        w.obj[x]["broken"] = False
    elif k == "too_heavy":
        w.obj[x]["heavy"] = False
    elif k == "fragile_item":
        w.obj[x]["fragile"] = False
    elif k == "object_moved":
        seen = next(o.last_seen for o in c.task.agent_view.objects if o.id == x)
        w.obj[x]["loc"] = seen
    elif k == "ambiguous_target":
        w.learned.add("identified:" + x)
    elif k == "person_knowledge":
        persona = next(h for h in c.task.human_persona if x in h.reveals)
        for hid in persona.reveals[x]:
            w.hidden.discard(hid)
            if hid in c.place:
                w.known_places.add(hid)
            else:
                w.known_conns.add(hid)
                w.known_door[hid] = w.door[hid]
    elif k == "person_busy":
        w.asks[x] = 99
    w.touch_objects()


def run_plan(task: Compiled, world: World, calls: Iterable[dict]) -> EnvController:
    ctrl = EnvController(task)
    ctrl.reset(world)
    for call in calls:
        if ctrl.done:
            break
        ctrl.step(call)
    return ctrl


def hidden_strings(task: TaskInstance) -> list[str]:
    """Strings that must never appear in what the agent sees at the start."""
    out = []
    for t in task.failure_triggers:
        out += [t.id, t.condition, t.effect, *t.recovery]
    st = task.env_state
    out += [p.id for p in st.places if p.hidden] + [p.name for p in st.places if p.hidden]
    out += [c.id for c in st.connections if c.hidden]
    out += [f.answer for f in st.facts]
    return [s for s in out if s]


def leaks(task: TaskInstance, first_observation: str) -> list[str]:
    """Validation of isolation: structural and textual checks of the agent's initial view."""
    problems = []
    view = task.agent_view
    text = view.model_dump_json() + " " + first_observation + " " + task.instruction
    for s in hidden_strings(task):
        if s in text:
            problems.append(f"hidden string {s!r} visible")
    truth = {o.id: o.location for o in task.env_state.objects}
    for t in task.failure_triggers:
        if t.kind in ("object_moved",):
            seen = next((o.last_seen for o in view.objects if o.id == t.target), None)
            if seen == truth[t.target]:
                problems.append(f"moved object {t.target} shown at its true place")
        if t.kind == "person_knowledge" and any(o.id == t.target for o in view.objects):
            problems.append(f"{t.target} (only a person knows where) is on the map")
    for g in task.goal:
        if g.op == "find_report":
            for o in view.objects:
                if o.type == g.object.type and (not g.object.color or o.color == g.object.color):
                    problems.append(f"search target {o.id} is on the map")
    return problems


def validate_instance(task: TaskInstance, cfg: BuildConfig) -> tuple[TaskInstance | None, str | None, bool]:
    """Return (instance with budget and optimal steps set, rejection reason, teacher solved)."""
    comp = Compiled(task)
    ctrl, steps = solve(comp)
    if not ctrl.success:
        return None, "oracle_failed", False
    optimal = len(steps)
    budget = min(cfg.max_budget, int(optimal * cfg.budget_factor) + cfg.budget_slack)
    if optimal > budget:
        return None, "over_budget", False
    # each obstacle is reachable and matters: the clean plan, run with only that obstacle, meets it and fails
    if comp.triggers:
        clean = comp.initial.clone()
        for t in comp.triggers:
            resolve_trigger(clean, t)
        cctrl, csteps = solve(comp, world=clean)
        if not cctrl.success:
            return None, "clean_variant_unsolved", False
        plan = [s[1] for s in csteps]
        for t in comp.triggers:
            wt = comp.initial.clone()
            if t.kind == "person_busy":
                # a busy helper only matters where help is needed: plan as if they were free, keep the rest
                free = comp.initial.clone()
                resolve_trigger(free, t)
                _, fsteps = solve(comp, world=free)
                run = run_plan(comp, wt, [s[1] for s in fsteps])
            else:
                for other in comp.triggers:
                    if other.id != t.id:
                        resolve_trigger(wt, other)
                run = run_plan(comp, wt, plan)
            if run.fired.get(t.id, 0) == 0:
                return None, f"trigger_not_reached:{t.kind}", False
            if run.success:
                return None, f"trigger_does_not_matter:{t.kind}", False
    first = EnvController(comp).reset()
    problems = leaks(task, first)
    if problems:
        return None, "leak", False
    final = task.model_copy(update={"step_budget": budget, "optimal_steps": optimal})
    tctrl, _ = solve(Compiled(final), privileged=False)
    return final, None, tctrl.success


def trace_of(steps, ctrl: EnvController) -> dict:
    picked, operated, asked, observed = [], [], [], []
    requests: dict[str, list[str]] = {}
    for _, call, res in steps:
        a = call["arguments"]
        if call["name"] == "pick_up" and res.ok:
            picked.append(a["object"])
        if call["name"] == "operate" and res.ok:
            operated.append(a["device"])
        if call["name"] in ("talk_to", "ask_for_help"):
            if a["person"] not in asked:
                asked.append(a["person"])
            if call["name"] == "ask_for_help":
                requests.setdefault(a["person"], []).append(a["request"])
        if call["name"] in ("search", "navigate") and res.ok:
            observed += [o for o in ctrl.compiled.obj if o in res.observation]
    entered = []
    for cid in ctrl.crossed:
        x = ctrl.compiled.conn[cid]
        entered += [x.a, x.b]
    return {"crossed": list(ctrl.crossed), "entered": sorted(set(entered)), "picked": picked,
            "operated": operated, "asked": asked, "requests": requests, "observed": observed}


# ----------------------------------------------------------------------------- the procedural builder

MEDIUM_KINDS = ("locked_door", "blocked_path", "object_moved", "device_malfunction", "fragile_item", "too_heavy",
                "restricted_area", "ambiguous_target", "person_knowledge")


class ProceduralBuilder:
    """Instruction seed -> [easy, medium, hard] validated instances (fewer if a variant is rejected)."""

    def __init__(self, scene: ScenePack, cfg: BuildConfig, stats: BuildStats | None = None):
        self.scene, self.cfg = scene, cfg
        self.stats = stats or BuildStats()

    def draft(self, seed: int, forbidden_texts: set[str], forbidden_layouts: set[str]):
        rng = random.Random(f"{self.scene.id}:{seed}")
        for _ in range(40):
            lay = sample_layout(self.scene, rng)
            if lay["layout_id"] in forbidden_layouts:
                continue
            kind = rng.choice(INSTRUCTION_KINDS)
            d = sample_instruction(self.scene, lay["env"], rng, kind)
            if d is None or d.text in forbidden_texts:
                continue
            return lay, d, rng
        return None

    def build(self, seed: int, split: str, forbidden_texts: set[str] = frozenset(),
              forbidden_layouts: set[str] = frozenset(), difficulties=DIFFICULTIES) -> list[TaskInstance]:
        got = self.draft(seed, set(forbidden_texts), set(forbidden_layouts))
        if got is None:
            for d in difficulties:
                self.stats.reject(d, "no_instruction")
            return []
        lay, draft, rng = got
        iid = _h({"scene": self.scene.id, "text": draft.text})
        out = []
        base_trace = None
        for diff in difficulties:
            inst, reason, solved = None, None, False
            for attempt in range(self.cfg.max_attempts):
                arng = random.Random(f"{self.scene.id}:{seed}:{diff}:{attempt}")
                cand = Candidate(self.scene, lay["env"], draft, arng)
                tid = f"{self.scene.id}-{split}-{seed}-{diff}"
                try:
                    if base_trace is None:
                        clean = cand.instance(tid, iid, "easy", lay["layout_id"], split, seed)
                        cc, cs = solve(Compiled(clean))
                        if not cc.success:
                            reason = "oracle_failed"
                            break
                        base_trace = trace_of(cs, cc)
                    if diff != "easy" and not self._obstacles(cand, diff, base_trace, tid, iid, lay, split, seed):
                        reason = "no_applicable_trigger"
                        continue
                    cand = cand.instance(tid, iid, diff, lay["layout_id"], split, seed)
                except ValidationError as e:
                    reason = "schema:" + str(e.errors()[0]["loc"][:2])
                    continue
                inst, reason, solved = validate_instance(cand, self.cfg)
                if inst is not None:
                    break
            if inst is None:
                self.stats.reject(diff, reason or "rejected")
                continue
            self.stats.accept(diff, solved)
            out.append(inst)
        return out

    def _obstacles(self, cand: Candidate, diff: str, trace: dict, tid, iid, lay, split, seed) -> bool:
        """Medium: one recoverable obstacle. Hard: two or more, each laid on the route the previous one forces
        (the plan is re-traced after each), and the person the plan must ask may be busy until asked twice."""
        def retrace() -> dict | None:
            try:
                inst = cand.instance(tid, iid, diff, lay["layout_id"], split, seed)
            except ValidationError:
                return None
            ctrl, steps = solve(Compiled(inst))
            return trace_of(steps, ctrl) if ctrl.success else None

        kinds = list(MEDIUM_KINDS)
        cand.rng.shuffle(kinds)
        need = 1 if diff == "medium" else self.cfg.hard_min_triggers
        want = 1 if diff == "medium" else cand.rng.randint(need, 3)
        applied = 0
        for k in kinds:
            if applied >= want:
                break
            if cand.apply(k, trace):
                applied += 1
                if diff == "hard":
                    trace = retrace()
                    if trace is None:
                        return False
        if (diff == "hard" or applied < need) and cand.apply("person_busy", trace):
            applied += 1
        return applied >= need


# a split's instances cand their seeds from their own range (test and any other split: 1_000_003 on)
_SPLIT_SEED_OFFSETS = {"train": 0, "rl": 2_000_029}


def build_split(scenes: list[ScenePack], split: str, n_per_scene: int, cfg: BuildConfig, stats: BuildStats,
                forbidden_texts: set[str] = frozenset(), forbidden_layouts: set[str] = frozenset(),
                difficulties=DIFFICULTIES, progress=None, make_builder=None) -> list[TaskInstance]:
    """`make_builder(scene, cfg, stats)` gives the InstanceBuilder per scene (default: ProceduralBuilder; the
    LLM builder plugs in here and goes through the same validation)."""
    out: list[TaskInstance] = []
    offset = _SPLIT_SEED_OFFSETS.get(split, 1_000_003)
    make_builder = make_builder or ProceduralBuilder
    for scene in scenes:
        b = make_builder(scene, cfg, stats)
        for i in range(n_per_scene):
            out += b.build(cfg.seed * 7_919 + offset + i, split, forbidden_texts, forbidden_layouts, difficulties)
            if progress:
                progress(1)
    return out


def target_combos(task: TaskInstance) -> set[tuple[str, str | None]]:
    """(type, colour) of each object the instruction targets, as the instruction words it: the goal's colour, or
    the colour of the one matching object when the instruction text says it ("the white phone charger" with a
    goal of type charger)."""
    out = set()
    words = set(task.instruction.lower().replace(".", " ").replace(",", " ").split())
    for g in task.goal:
        ref = g.object
        if ref is None:
            continue
        color = ref.color
        if color is None:
            colors = {o.color for o in task.env_state.objects if o.type == ref.type}
            if len(colors) == 1:
                color = next(iter(colors))
            if color is not None and color.lower() not in words:
                color = None
        out.add((ref.type, color))
    return out


def compositional_split(train: list[TaskInstance], test: list[TaskInstance]) -> list[TaskInstance]:
    """Test tasks whose every target (type, colour) combination was never a target in training, although the
    type and the colour each were (so the words are known and only the combination is new)."""
    seen = set().union(*(target_combos(t) for t in train)) if train else set()
    types = {c[0] for c in seen}
    colors = {c[1] for c in seen if c[1]}
    out = []
    for t in test:
        combos = target_combos(t)
        if combos and all(c not in seen and c[0] in types and (c[1] is None or c[1] in colors) for c in combos) \
                and any(c[1] for c in combos):
            out.append(t)
    return out
