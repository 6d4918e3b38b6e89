"""The policy side of pixel evaluation: mission parsing, the skill policies (perception-only expert, random, any
chat model through the shared prompt builder and parser) and `PixelAgent`, which turns frames into primitive
actions: perceive -> update the belief -> continue the running skill, or ask the policy for the next skill call.

Nothing here reads an environment: the agent gets an RGB frame and the mission text, and answers with a MiniGrid
action index (or none, or "finished") plus what it perceived and which skill calls it made (for the evaluator's
metrics). `evaluation.isolation` runs it in its own process.
"""

from __future__ import annotations

import heapq
import random
import re
from dataclasses import dataclass

import numpy as np

from agent.instructions import check_granularity, instruction_text
from agent.policies import decide
from agent.prompt import StepMemory, build_step_messages
from evaluation.gridworld import GridBelief, Outcome, SkillExecutor
from evaluation.perception import DIR_VEC, SpriteDetector
from sandbox.agents import random_call

# ----------------------------------------------------------------------------- BabyAI missions

_DESC = (r"(?:the|a) (?:(red|green|blue|purple|yellow|grey) )?(key|ball|box|door|object)"
         r"(?: (in front of you|behind you|on your left|on your right))?")
_ACTIONS = [("go_to", re.compile(rf"^go to {_DESC}$")), ("pick_up", re.compile(rf"^pick up {_DESC}$")),
            ("open", re.compile(rf"^open {_DESC}$")), ("put_next", re.compile(rf"^put {_DESC} next to {_DESC}$"))]
_LOC = {"in front of you": "front", "behind you": "behind", "on your left": "left", "on your right": "right"}


@dataclass(frozen=True)
class Desc:
    type: str | None
    color: str | None
    loc: str | None = None

    @property
    def text(self) -> str:
        return " ".join(x for x in (self.color, self.type or "object") if x)


@dataclass(frozen=True)
class Subtask:
    op: str  # go_to | pick_up | open | put_next
    obj: Desc
    other: Desc | None = None


class MissionError(ValueError):
    pass


def _desc(color, typ, loc) -> Desc:
    return Desc(None if typ == "object" else typ, color, _LOC.get(loc) if loc else None)


def parse_mission(mission: str) -> list[Subtask]:
    """BabyAI's grammar (actions go to / pick up / open / put next to; `and`, `, then`, `after you`) as subtasks in
    the order to do them."""
    m = mission.strip().rstrip(".").lower()

    def clause(text: str) -> list[Subtask]:
        out = []
        for part in text.split(" and "):
            for op, rx in _ACTIONS:
                hit = rx.match(part.strip())
                if hit:
                    g = hit.groups()
                    out.append(Subtask(op, _desc(*g[:3]), _desc(*g[3:6]) if op == "put_next" else None))
                    break
            else:
                raise MissionError(f"cannot read the mission part {part.strip()!r} of {mission!r}")
        return out

    if ", then " in m:
        a, b = m.split(", then ", 1)
        return clause(a) + clause(b)
    if " after you " in m:
        a, b = m.split(" after you ", 1)
        return clause(b) + clause(a)
    return clause(m)


def task_text(mission: str) -> str:
    """The mission as the sandbox words a task ("go to a red ball" -> "Go to the red ball."): BabyAI's "a" (one of
    several matching objects) becomes "the", as any matching object satisfies it."""
    t = re.sub(r"\ba (?=(?:red |green |blue |purple |yellow |grey )?(?:key|ball|box|door|object)\b)", "the ",
               mission.strip().rstrip("."))
    return t[:1].upper() + t[1:] + "."


def mission_procedure(mission: str) -> list[dict]:
    """The mission as plan steps for `--instructions step|visual` (`agent.instructions`), after BabyAI's verifier
    structure and its bot's plan: each subtask in the order to do it, a pick-up or an open preceded by going to
    the thing, a put-next by picking the object up; each names only what the mission names (`{"text",
    "things"}`, the things by their words, "red ball", looked up in the agent's belief for visual anchors)."""
    def said(d: Desc) -> str:   # as the mission says it, with its location words
        return d.text + {"front": " in front of you", "behind": " behind you", "left": " on your left",
                         "right": " on your right"}.get(d.loc or "", "")

    steps = []
    for st in parse_mission(mission):
        what = said(st.obj)
        if st.op == "go_to":
            steps.append({"text": f"go to the {what}", "things": [st.obj.text]})
        elif st.op in ("pick_up", "open"):
            steps += [{"text": f"go to the {what}", "things": [st.obj.text]},
                      {"text": f"{st.op.replace('_', ' ')} the {what}", "things": [st.obj.text]}]
        else:
            steps += [{"text": f"pick up the {what}", "things": [st.obj.text]},
                      {"text": f"put it next to the {said(st.other)}", "things": [st.other.text]}]
    return steps


# ----------------------------------------------------------------------------- skill policies


class PixelExpert:
    """The perception-only scripted policy (`--policy expert` on pixels): it reads the mission and plans skill
    calls from the belief alone (what the frames showed), exploring unvisited rooms for what it has not seen,
    fetching the key of a locked door in its way and putting down what it holds before picking up something
    else."""

    name = "expert"

    def reset(self, mission: str, b: GridBelief, seed: int = 0) -> None:
        self.todo = parse_mission(mission)
        self.i = 0
        self.start_pose = b.pose
        self.start_room = b.place
        self.done_goto: set[str] = set()
        self.opened: set[str] = set()
        self.placed: set[str] = set()
        self.last: tuple[dict, Outcome] | None = None
        self.failed: set[str] = set()  # rooms it could not walk to (behind a locked door, say)
        self._unlocking: set[str] = set()
        self._moving: set[str] = set()
        self.centred: set[str] = set()  # rooms looked at again from their centre
        self.looked_through: set[str] = set()  # doors opened or faced to see the unexplored side
        self.searched: set[str] = set()  # rooms searched to their edges (first-person)

    def observe(self, call, outcome: Outcome) -> None:
        if isinstance(call, dict):
            self.last = (call, outcome)
            if call.get("name") == "navigate" and not outcome.ok:
                self.failed.add(call["arguments"].get("target", ""))

    # -- matching what the frames showed against a description

    def _loc_ok(self, b: GridBelief, pos, loc: str | None) -> bool:
        if loc is None:
            return True
        x, y, d = self.start_pose
        v = (pos[0] - x, pos[1] - y)
        f = DIR_VEC[d]
        r = (-f[1], f[0])
        if b.room_at(pos) != self.start_room and not any(pos == b.doors[i]["pos"] for i in b.doors):
            return False
        dot_f, dot_r = v[0] * f[0] + v[1] * f[1], v[0] * r[0] + v[1] * r[1]
        return {"front": dot_f > 0, "behind": dot_f < 0, "left": dot_r < 0, "right": dot_r > 0}[loc]

    def matches(self, b: GridBelief, desc: Desc) -> list[str]:
        out = []
        if desc.type in (None, "door"):
            out += [i for i, d in b.doors.items() if desc.color in (None, d["color"]) and
                    self._loc_ok(b, d["pos"], desc.loc)]
        if desc.type != "door":
            out += [o.oid for o in b.known_objects() if desc.type in (None, o.type) and desc.color in (None, o.color)
                    and (o.oid == b.holding or self._loc_ok(b, o.pos, desc.loc))]
        return out

    def _cell(self, b: GridBelief, eid: str):
        return b.doors[eid]["pos"] if eid in b.doors else b.objects[eid].pos

    def _nearest(self, b: GridBelief, ids: list[str]) -> str | None:
        best = None
        for eid in ids:
            if eid == b.holding:
                return eid
            cell = self._cell(b, eid)
            goals = {(cell[0] + dx, cell[1] + dy) for dx, dy in DIR_VEC}
            d = b.distance({g for g in goals if b.passable(g)})
            d = 10_000 + len(b.path(goals, avoid=set()) or []) if d is None else d
            if best is None or (d, eid) < best:
                best = (d, eid)
        return best[1] if best else None

    def _in_way(self, b: GridBelief, eid: str) -> str | None:
        """When no free way leads to `eid`: the first obstacle (a locked door or an object) on a shortest way that
        may pass through obstacles."""
        if eid in b.room_cells:  # a room: any of its free cells
            goals = {c for c in b.room_cells[eid] if c not in b.at}
            cell = None
            if b.path(goals) is not None:
                return None
        else:
            cell = self._cell(b, eid)
            if b.path(b.stand_cells(cell)) is not None:
                return None
            goals = {(cell[0] + dx, cell[1] + dy) for dx, dy in DIR_VEC}
        # cheapest way when crossing an obstacle costs extra: a locked door (unlock it) 20 steps, an object (move
        # it aside) 50, so a door is unlocked rather than objects shuffled
        start = b.pose[:2]
        prev, cost, heap = {start: None}, {start: 0}, [(0, start)]
        w, h = b.cells.shape[:2]
        while heap:
            c0, cur = heapq.heappop(heap)
            if c0 > cost[cur]:
                continue
            if cur in goals:
                walk = [cur]
                while prev[walk[-1]] is not None:
                    walk.append(prev[walk[-1]])
                for c in walk[::-1]:
                    if c in b.at:
                        return b.at[c]
                    if c in b.door_at and b.doors[b.door_at[c]]["state"] == "locked":
                        return b.door_at[c]
                return None
            for dx, dy in DIR_VEC:
                nxt = (cur[0] + dx, cur[1] + dy)
                if nxt == cell or not (0 <= nxt[0] < w and 0 <= nxt[1] < h):
                    continue
                door = b.door_at.get(nxt)
                step = 1 if b.passable(nxt) else 50 if nxt in b.at else 20 if door else None
                if step is None or cost[cur] + step >= cost.get(nxt, 1 << 30):
                    continue
                cost[nxt], prev[nxt] = cost[cur] + step, cur
                heapq.heappush(heap, (cost[nxt], nxt))
        return None

    def _clear(self, b: GridBelief, eid: str) -> tuple[str, dict] | None:
        """Calls that clear the way to `eid` (unlock a door, move an object aside), or None when it is free."""
        obstacle = self._in_way(b, eid)
        if obstacle is None:
            return None
        if obstacle in b.doors:
            return self._unlock(b, obstacle)
        if obstacle in self._moving:
            return None
        self._moving.add(obstacle)
        try:
            if b.holding == obstacle:  # picked up to clear the way: put it down out of the way
                return (f"I put the {b.objects[obstacle].name} down out of the way.",
                        {"name": "place", "arguments": {"object": obstacle, "target": b.place}})
            return self._get(b, obstacle, why=f"The {b.objects[obstacle].name} is in my way; I move it aside.")
        finally:
            self._moving.discard(obstacle)

    # -- the plan

    def _explore(self, b: GridBelief, what: str) -> tuple[str, dict]:
        # not a room behind a door this plan is already unlocking (its key is what is being looked for)
        todo = [r for r in b.unvisited() if r not in self.failed and self._in_way(b, r) not in self._unlocking]
        if todo:
            clear = self._clear(b, todo[0])
            if clear:
                return clear
            return (f"I have not seen the {what} yet; I'll look in the nearest room I have not been in.",
                    {"name": "navigate", "arguments": {"target": todo[0]}})
        # first-person: rooms appear only once seen; look through the doors whose far side is unexplored
        def near(kv):
            d = b.distance(b.stand_cells(kv[1]["pos"]))
            return (d if d is not None else 10_000, kv[0])

        for did, door in sorted(b.doors.items(), key=near):
            if "unexplored" not in door["rooms"] or did in self.looked_through | self.failed:
                continue
            if door["state"] == "locked":
                continue
            clear = self._clear(b, did)
            if clear:
                return clear
            if not self._facing(b, did):
                return f"I go to the {did} to see what lies behind it.", {"name": "navigate",
                                                                           "arguments": {"target": did}}
            self.looked_through.add(did)
            if door["state"] == "closed":
                return f"I open the {did} to see behind it.", {"name": "open", "arguments": {"target": did}}
        # behind a locked door lies what is still unseen: fetch its key and unlock it
        for did, door in sorted(b.doors.items(), key=near):
            if "unexplored" in door["rooms"] and door["state"] == "locked" and did not in self._unlocking | \
                    self.failed:
                return self._unlock(b, did)
        # first-person: a room seen only in part is searched to its edges
        if b.view == "egocentric" and b.place not in self.searched:
            self.searched.add(b.place)
            return (f"I have not seen the {what}; I search this room to its edges.",
                    {"name": "search", "arguments": {"query": what}})
        # every room entered, the object unseen: look again from each room's centre (this one first)
        again = [r for r in [b.place] + [r for r, _ in b.rooms] if r not in self.centred | self.failed]
        if again:
            self.centred.add(again[0])
            return (f"I have not seen the {what}; I look again from the middle of the {dict(b.rooms)[again[0]]}.",
                    {"name": "navigate", "arguments": {"target": again[0]}})
        return f"I have not seen the {what}; I look around here.", {"name": "look_around", "arguments": {}}

    def _get(self, b: GridBelief, oid: str, why: str | None = None) -> tuple[str, dict]:
        """Calls that end with `oid` held."""
        o = b.objects[oid]
        clear = self._clear(b, oid)   # first: the key in hand may be what unlocks the way
        if clear:
            return clear
        if b.holding and b.holding != oid:
            return (f"My hands are full; I put the {b.objects[b.holding].name} down first.",
                    {"name": "place", "arguments": {"object": b.holding, "target": b.place}})
        if not self._facing(b, oid):
            return why or f"I go to the {o.name}.", {"name": "navigate", "arguments": {"target": oid}}
        return f"The {o.name} is in front of me; I pick it up.", {"name": "pick_up", "arguments": {"object": oid}}

    def _facing(self, b: GridBelief, eid: str) -> bool:
        return b.front() == self._cell(b, eid)

    def _unlock(self, b: GridBelief, door: str) -> tuple[str, dict]:
        if door in self._unlocking:  # its key lies behind the same door: nothing to fetch it with
            return self._explore(b, f"{b.doors[door]['color']} key")
        self._unlocking.add(door)
        try:
            return self._unlock_plan(b, door)
        finally:
            self._unlocking.discard(door)

    def _unlock_plan(self, b: GridBelief, door: str) -> tuple[str, dict]:
        color = b.doors[door]["color"]
        held = b.objects.get(b.holding) if b.holding else None
        if held is None or held.type != "key" or held.color != color:
            keys = [o.oid for o in b.known_objects() if o.type == "key" and o.color == color and o.pos is not None]
            key = self._nearest(b, keys)
            if key is None:
                return self._explore(b, f"{color} key")
            return self._get(b, key)
        if not self._facing(b, door):
            return f"I take the {color} key to the locked {door}.", {"name": "navigate", "arguments": {"target": door}}
        return f"I hold the {color} key; I unlock the {door}.", {"name": "open", "arguments": {"target": door}}

    def act(self, b: GridBelief) -> tuple[str, dict]:
        while self.i < len(self.todo):
            st = self.todo[self.i]
            call = self._step(b, st)
            if call is not None:
                return call
            self.i += 1
            self.target = None
        return "Every part of the mission is done.", {"name": "finish", "arguments": {"summary": "mission done"}}

    def _step(self, b: GridBelief, st: Subtask) -> tuple[str, dict] | None:
        """The next call for one subtask, or None when it is done."""
        last_call, last_out = self.last if self.last else ({}, None)
        ids = self.matches(b, st.obj)
        if st.op == "go_to":
            if last_out is not None and last_out.ok and last_call.get("name") == "navigate" and \
                    last_call["arguments"]["target"] in ids and last_call["arguments"]["target"] not in self.done_goto:
                self.done_goto.add(last_call["arguments"]["target"])
                self.last = None
                return None
            target = self._nearest(b, [i for i in ids if i != b.holding])
            if target is None:
                return self._explore(b, st.obj.text)
            clear = self._clear(b, target)
            if clear:
                return clear
            return f"I go to the {st.obj.text}.", {"name": "navigate", "arguments": {"target": target}}
        if st.op == "pick_up":
            held = b.holding in ids
            if held and last_call.get("name") == "pick_up" and last_out is not None and last_out.ok:
                self.last = None
                return None
            target = self._nearest(b, [i for i in ids if i != b.holding]) if not held else b.holding
            if target is None:
                return self._explore(b, st.obj.text)
            if held:  # holding a match from an earlier step: BabyAI counts the pick-up action, so do it again
                return (f"I put the {b.objects[target].name} down to pick it up for this task.",
                        {"name": "place", "arguments": {"object": target, "target": b.place}})
            return self._get(b, target)
        if st.op == "open":
            doors = [i for i in ids if i in b.doors]
            if last_out is not None and last_out.ok and last_call.get("name") == "open" and \
                    last_call["arguments"]["target"] in doors:
                self.last = None
                return None
            closed = [d for d in doors if b.doors[d]["state"] != "open"]
            target = self._nearest(b, closed or doors)
            if target is None:
                return self._explore(b, st.obj.text)
            clear = self._clear(b, target)
            if clear:
                return clear
            if b.doors[target]["state"] == "locked":
                return self._unlock(b, target)
            if not self._facing(b, target):
                return f"I go to the {target}.", {"name": "navigate", "arguments": {"target": target}}
            if b.doors[target]["state"] == "open":  # BabyAI counts the opening: close it first
                return f"The {target} stands open; I close it to open it.", {"name": "close",
                                                                          "arguments": {"target": target}}
            return f"I open the {target}.", {"name": "open", "arguments": {"target": target}}
        # put_next
        if last_out is not None and last_out.ok and last_call.get("name") == "place" and \
                last_call["arguments"]["object"] in ids and last_call["arguments"]["target"] in \
                self.matches(b, st.other):
            self.last = None
            return None
        if b.holding not in ids:
            target = self._nearest(b, ids)
            if target is None:
                return self._explore(b, st.obj.text)
            return self._get(b, target)
        others = [i for i in self.matches(b, st.other) if i != b.holding]
        other = self._nearest(b, others)
        if other is None:
            return self._explore(b, st.other.text)
        clear = self._clear(b, other)
        if clear:
            return clear
        near = b.place in b.doors[other]["rooms"] if other in b.doors else b.room_of_obj(other) == b.place
        what = other if other in b.doors else b.objects[other].name
        if not near:
            return f"I carry it to the {what}.", {"name": "navigate", "arguments": {"target": other}}
        return (f"I put the {b.objects[b.holding].name} next to the {what}.",
                {"name": "place", "arguments": {"object": b.holding, "target": other}})


class PixelRandom:
    """Uniform over skills, arguments drawn from the ids in the known map (a floor for every metric)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def reset(self, mission: str, b: GridBelief, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def observe(self, call, outcome) -> None:
        pass

    def act(self, b: GridBelief) -> tuple[str, dict]:
        k = b.known()
        ids = [p for p, _ in k["places"]] + [o for o, _, _ in k["objects"]] + [c for c, *_ in k["connections"]]
        return "random", random_call(self.rng, ids)


class PixelModel:
    """Any `agent.models.ChatModel` (a sandbox-trained student) through the shared prompt builder and parser: the
    prompt is `build_step_messages` over the belief's known map, exactly the sandbox's format."""

    def __init__(self, client, name: str | None = None, memory_size: int = 4, budget: int = 30,
                 instructions: str = "goal"):
        self.client = client
        self.name = name or getattr(client, "name", "model")
        self.memory_size = memory_size
        self.budget = budget
        self.instructions = check_granularity(instructions)   # the task line: goal | step | visual

    def reset(self, mission: str, b: GridBelief, seed: int = 0) -> None:
        self.task = task_text(mission)
        self.procedure = mission_procedure(mission)
        self.memory = StepMemory(size=self.memory_size)
        self.seed = seed
        self.step = 0
        self.observation = b.describe()
        self.last_prompt: list[dict] = []
        self.last_raw = ""

    def observe(self, call, outcome: Outcome) -> None:
        self.memory.add(call if isinstance(call, dict) else None, outcome.error, outcome.text)
        self.observation = outcome.text

    def hint(self, note: str) -> None:
        """The deadlock intervention: the observation the next prompt shows ends with the note."""
        if note not in self.observation:
            self.observation = f"{self.observation}\n{note}"

    def act(self, b: GridBelief) -> tuple[str, dict | str]:
        known = b.known()
        line = None if self.instructions == "goal" else instruction_text(self.task, self.procedure,
                                                                          self.instructions, known)
        messages = build_step_messages(self.task, known, self.memory, self.observation, self.step, self.budget,
                                       task=line)
        self.last_prompt = messages
        thought, action, self.last_raw, _ = decide(self.client, messages, self.seed, self.step)
        self.step += 1
        return thought, action


# ----------------------------------------------------------------------------- the agent


class PixelAgent:
    """Frames in, primitive actions out (module docstring). `skill_budget` bounds the skill calls of an episode;
    `idle_calls` bounds the calls that move nothing within one turn (invalid calls, reports), after which the turn
    passes with no action, so a looping policy shows up as a deadlock instead of hanging the evaluation."""

    def __init__(self, policy, view: str = "topdown", tile_size: int = 8, skill_budget: int = 30,
                 idle_calls: int = 4, perception=None):
        self.policy = policy
        self.view, self.skill_budget, self.idle_calls = view, skill_budget, idle_calls
        self.perception = perception or SpriteDetector(tile_size)

    def reset(self, mission: str, frame: np.ndarray, seed: int = 0) -> dict:
        if self.view == "egocentric":
            from evaluation.egocentric import EgoBelief
            self.b = EgoBelief()
        else:
            self.b = GridBelief(self.view)
        p = self.perception.perceive(frame, self.view)
        self.b.update(p)
        if self.b.pose is None:
            raise ValueError("the first frame shows no agent: cannot start")
        self.exec = SkillExecutor(self.b)
        self.policy.reset(mission, self.b, seed)
        self.policy.budget = self.skill_budget  # a model's prompt shows "Step k/budget"
        self.run = None
        self.current = None
        self.calls = 0
        self.last_action = None
        return {"percept": p.to_payload(), "pose": self.b.pose, "start": getattr(self.b, "start", self.b.pose)}

    def act(self, frame: np.ndarray, note: str | None = None) -> dict:
        """The next primitive action for `frame`. `note`: the deadlock hint, shown to a model policy with its
        next decision (scripted policies do not read text)."""
        if note is not None and hasattr(self.policy, "hint"):
            self.policy.hint(note)
        p = self.perception.perceive(frame, self.view)
        self.b.update(p, self.last_action)
        events = []
        idle = 0
        while True:
            if self.run is None:
                if self.calls >= self.skill_budget:
                    return self._reply(None, True, events, p, "skill budget spent")
                if idle >= self.idle_calls:
                    return self._reply(None, False, events, p)
                thought, call = self.policy.act(self.b)
                self.calls += 1
                self.current = (thought, call)
                if isinstance(call, dict):
                    self.run = self.exec.start(call)
                else:
                    self.run = SkillExecutor._fail("parse_error", "Your output held no readable skill call.")
                self.moved = False
            try:
                action = next(self.run)
            except StopIteration as stop:
                outcome = stop.value
                thought, call = self.current
                events.append({"thought": thought, "call": call, "ok": outcome.ok, "error": outcome.error,
                               "observation": outcome.text, "prompt": getattr(self.policy, "last_prompt", None),
                               "raw": getattr(self.policy, "last_raw", None)})
                self.policy.observe(call, outcome)
                self.run = None
                if outcome.finish:
                    return self._reply(None, True, events, p, "finish")
                if not self.moved:
                    idle += 1
                continue
            self.moved = True
            self.last_action = action
            return self._reply(action, False, events, p)

    def _reply(self, action, finish: bool, events, p, why: str | None = None) -> dict:
        if action is None:
            self.last_action = None
        return {"action": action, "finish": finish, "why": why, "events": events, "calls": self.calls,
                "percept": p.to_payload(), "pose": self.b.pose, "start": getattr(self.b, "start", None)}
