"""The expert planner, in two roles.

* Oracle (`privileged=True`): reads the true state to prove an instance solvable and count its steps.
* Teacher (`privileged=False`, the embedded default teacher): acts only on what the agent could know:
  the instruction's goal, the visible map, observations and replies so far (the controller's belief
  fields). It searches or asks when it does not know where something is, tries the obvious action,
  meets the obstacle, and recovers. Its ReAct thoughts cite only facts it has seen.

Both roles run the same reactive policy; only `Knowledge` differs, so the oracle's plan length is an
honest yardstick for the teacher.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from sandbox.controller import EnvController, StepResult
from sandbox.schema import GoalStep, ObjectRef
from sandbox.world import HELD, World


class Knowledge:
    """What the planner may read. The teacher's view touches only belief fields of the World."""

    def __init__(self, ctrl: EnvController, privileged: bool):
        self.ctrl, self.c, self.priv = ctrl, ctrl.compiled, privileged

    @property
    def world(self) -> World:
        return self.ctrl.world

    # the agent always knows where it is and what it holds
    @property
    def here(self) -> str:
        return self.world.agent_place

    @property
    def holding(self) -> list[str]:
        return self.world.holding

    def loc(self, oid: str) -> str | None:
        if self.priv:
            loc = self.world.obj[oid]["loc"]
            return loc
        return self.world.known_obj.get(oid)

    def place_of_loc(self, loc: str | None) -> str | None:
        if loc is None:
            return None
        if loc == HELD:
            return self.here
        for _ in range(16):
            if loc in self.c.place:  # a place missing from the agent's map cannot be walked to yet
                return loc if loc in self.world.known_places else None
            nxt = self.loc(loc) if loc in self.c.obj else None
            if nxt is None:
                return None
            loc = nxt
        return None

    def place_of(self, oid: str) -> str | None:
        return self.place_of_loc(self.loc(oid))

    def known(self, oid: str) -> bool:
        return oid in self.world.known_obj

    def matching(self, ref: ObjectRef) -> list[str]:
        """Objects the agent knows of that fit the instruction's description (type, colour, owner)."""
        if ref.id is not None:
            return [ref.id] if ref.id in self.c.obj and (self.priv or ref.id in self.world.known_obj) else []
        out = []
        ids = self.c.obj_order if self.priv else [o for o in self.c.obj_order if o in self.world.known_obj]
        for oid in ids:
            o = self.c.obj[oid]
            if o.type != ref.type or (ref.color and o.color != ref.color):
                continue
            own = self.owner(oid)
            if ref.owner and own is not None and own != ref.owner:
                continue
            out.append(oid)
        return out

    def owner(self, oid: str) -> str | None:
        if self.priv:
            return self.c.obj[oid].owner
        for f in self.world.learned:
            if f.startswith(f"owner:{oid}="):
                return f.split("=", 1)[1]
        return None

    def flag(self, kind: str, eid: str) -> bool:
        """An obstacle fact: locked / blocked / restricted / broken / heavy / fragile."""
        if not self.priv:
            return f"{kind}:{eid}" in self.world.learned
        w = self.world
        if kind == "locked":
            return w.door.get(eid) == "locked"
        if kind == "blocked":
            return w.blocked.get(eid, False)
        if kind == "restricted":
            return w.restricted.get(eid, False) and ("permit:" + eid) not in w.learned
        return bool(w.obj[eid][kind]) if eid in w.obj else False

    def route(self, goal: str, avoid: bool = True) -> list[tuple[str, str]] | None:
        w = self.world
        if goal not in w.known_places:
            return None
        if not self.priv or not avoid:
            return w.known_route(w.agent_place, goal, avoid_obstacles=avoid)
        # oracle: the known map, with the true obstacles avoided
        extra = frozenset([cid for cid in w.known_conns if w.blocked[cid] or w.door[cid] == "locked"] +
                          [p for p in w.known_places if w.restricted[p] and ("permit:" + p) not in w.learned])
        return w.known_route(w.agent_place, goal, avoid_obstacles=True, extra=extra)

    def person_place(self, pid: str) -> str | None:
        if self.priv:
            return self.world.person_place[pid]
        return self.world.known_person.get(pid)

    def people(self) -> list[str]:
        if self.priv:
            return list(self.c.person)
        return [p for p in self.c.person if p in self.world.known_person]

    def can_help(self, pid: str, request: str) -> bool:
        if self.priv:
            persona = self.c.persona.get(pid)
            return bool(persona and request in persona.capabilities
                        and any(r.request == request for r in persona.policy))
        return True  # the teacher cannot know; it asks and learns

    def knows_about(self, pid: str, oid: str) -> bool:
        if self.priv:
            persona = self.c.persona.get(pid)
            return bool(persona and oid in persona.knowledge)
        return True


@dataclass
class Memory:
    stage: int = 0
    searched: set = field(default_factory=set)      # (place, query)
    asked: set = field(default_factory=set)         # (person, topic)
    refused: set = field(default_factory=set)       # (person, request)
    tried: dict = field(default_factory=dict)       # repr(call) -> failures
    failures: dict = field(default_factory=dict)    # repr(call) + observation -> count
    reported: set = field(default_factory=set)      # stage indices reported
    operated: set = field(default_factory=set)
    ambiguous_seen: set = field(default_factory=set)
    placed_next: set = field(default_factory=set)
    told: dict = field(default_factory=dict)        # topic -> reply text
    gave_up: bool = False
    commit: dict = field(default_factory=dict)      # destination -> the obstacle being dealt with
    no_key: set = field(default_factory=set)        # locked doors whose key cannot be reached


class ExpertPlanner:
    """Reactive expert: `act(ctrl)` returns (thought, call); `observe(call, result)` updates its memory."""

    def __init__(self, ctrl: EnvController, privileged: bool = False):
        self.ctrl = ctrl
        self.k = Knowledge(ctrl, privileged)
        self.priv = privileged
        self.goal: list[GoalStep] = ctrl.task.goal
        self.m = Memory()
        self._handling: set = set()

    # ------------------------------------------------------------------ driver

    def act(self) -> tuple[str, dict]:
        if self.m.gave_up:
            return "I cannot find a way to complete the task, so I stop here.", _call("finish", summary="gave up")
        while self.m.stage < len(self.goal):
            a = self._stage(self.m.stage, self.goal[self.m.stage])
            if a is None:
                self.m.stage += 1
                continue
            return a
        return "Every part of the instruction is done.", _call("finish", summary="task complete")

    def observe(self, call: dict, res: StepResult, own: bool = True) -> None:
        """Update the memory with a call's result. `own=False`: another policy chose the call (the expert labels
        or takes over a student's episode): what it revealed is remembered, but a report or an operation the
        expert did not choose does not count as its stage done, and its failures do not count towards giving
        up (the student's loop is not the expert's)."""
        key = repr(call)
        fail_key = key + res.observation  # the same failure three times: stop instead of looping
        if not res.ok:
            if own:
                self.m.failures[fail_key] = self.m.failures.get(fail_key, 0) + 1
                if self.m.failures[fail_key] >= 3:
                    self.m.gave_up = True
            self.m.tried[key] = self.m.tried.get(key, 0) + 1
        n = call["name"]
        a = call.get("arguments", {})
        if n == "search":
            self.m.searched.add((self.k.here, a["query"]))
        if n in ("talk_to", "ask_for_help"):
            busy = res.error == "refused" and "again" in res.observation
            topic = a.get("topic") or a.get("target")
            if res.error == "refused" and not busy:
                self.m.refused.add((a["person"], a.get("request", "talk")))
            if res.ok:
                self.m.asked.add((a["person"], topic))
                self.m.told[topic] = res.observation.split('says: "', 1)[-1].rstrip('"')
            elif not busy:
                self.m.asked.add((a["person"], topic))
        if n == "report" and res.ok and own:
            self.m.reported.add(self.m.stage)
        if n == "operate" and (res.ok or "already" in res.observation) and own:
            self.m.operated.add(self.m.stage)
        if n == "place" and res.ok:
            self.m.placed_next.add((a["object"], a["target"]))
        if n == "pick_up" and res.error == "trigger_fired" and "not sure which" in res.observation:
            self.m.ambiguous_seen.add(a["object"])

    def run(self, max_steps: int | None = None) -> list[tuple[str, dict, StepResult]]:
        """Play a whole episode on the controller (from its current state)."""
        out = []
        budget = max_steps or self.ctrl.task.step_budget
        while not self.ctrl.done and self.ctrl.steps < budget:
            thought, call = self.act()
            res = self.ctrl.step(call)
            self.observe(call, res)
            out.append((thought, call, res))
        return out

    # ------------------------------------------------------------------ names for thoughts

    def _n(self, eid: str) -> str:
        return self.ctrl.compiled.display_name(eid)

    # ------------------------------------------------------------------ stages

    def _stage(self, i: int, g: GoalStep):
        k = self.k
        if g.op == "go_to":
            if g.place:
                return self.move_to(g.place, f"the instruction asks me to go to the {self._n(g.place)}")
            oid = self.resolve(g.object)
            if oid is None:
                return self.find(g.object)
            if self.ctrl.world.agent_near == oid:
                return None
            p = k.place_of(oid)
            if p is None:
                return self.find(g.object)
            if p != k.here:
                return self.move_to(p, f"the {self._n(oid)} is in the {self._n(p)}", obj=oid)
            return (f"The {self._n(oid)} is here; I'll walk up to it.", _call("navigate", target=oid))
        if g.op in ("find_report", "inspect_report"):
            if i in self.m.reported:
                return None
            oid = self.resolve(g.object)
            if oid is None:
                return self.find(g.object)
            p = k.place_of(oid)
            if p is None:
                return self.find(g.object)
            if g.op == "find_report":
                if not self._seen_where_it_is(oid):
                    if p != k.here:
                        return self.move_to(p, f"I believe the {self._n(oid)} is in the {self._n(p)}")
                    return self.reveal_here(oid)
                return (f"I have seen the {self._n(oid)} in the {self._n(p)}, so I report that.",
                        _call("report", answer=p))
            if p != k.here:
                return self.move_to(p, f"the {self._n(oid)} is in the {self._n(p)}")
            state = self._seen_state(oid, g.attribute)
            if state is None or ("inspected:" + oid) not in self.ctrl.world.learned:  # check it properly
                return (f"I'll inspect the {self._n(oid)} to see whether it is {g.attribute}.",
                        _call("inspect", target=oid))
            word = _STATE_WORDS[g.attribute][state]
            return (f"I inspected the {self._n(oid)}: it is {word}. I report that.",
                    _call("report", answer=f"The {self._n(oid)} is {word}"))
        if g.op == "ask_report":
            if i in self.m.reported:
                return None
            if g.fact in self.m.told:
                return (f"{self._n(g.person)} told me: {self.m.told[g.fact]} I report it.",
                        _call("report", answer=self.m.told[g.fact]))
            return self.talk(g.person, g.fact, f"the instruction asks me to learn {self._fact_q(g.fact)} "
                                               f"from {self._n(g.person)}")
        if g.op == "operate":
            if i in self.m.operated:
                return None
            oid = self.resolve(g.object)
            if oid is None:
                return self.find(g.object)
            p = k.place_of(oid)
            if p is None:
                return self.find(g.object)
            if k.flag("broken", oid):
                return self.get_help("repair", oid, why=f"the {self._n(oid)} shows an error")
            if p != k.here:
                return self.move_to(p, f"the {self._n(oid)} is in the {self._n(p)}")
            verb = "on" if g.action == "turn_on" else "off"
            return (f"I'm at the {self._n(oid)}; I'll turn it {verb}.",
                    _call("operate", device=oid, action=g.action))
        if g.op == "open_door":
            d = g.door
            if self.ctrl.world.known_door.get(d) == "open":
                return None
            return self.open_door(d)
        if g.op == "fetch":
            return self.fetch(g)
        raise ValueError(f"unknown goal op {g.op}")

    # ------------------------------------------------------------------ facts

    def _fact_q(self, fid: str) -> str:
        f = self.ctrl.compiled.fact.get(fid)
        return f.question if f else fid

    def _seen_where_it_is(self, oid: str) -> bool:
        w = self.ctrl.world
        kl = w.known_obj.get(oid)
        if kl is None:
            return False
        # only what was seen (or told) this episode counts, not the map's last-known position
        known = ("seen:" + oid) in w.learned or ("told_where:" + oid) in w.learned
        return known and (kl == w.obj[oid]["loc"] if self.priv else True)

    def _seen_state(self, oid: str, attr: str) -> bool | None:
        for v in (True, False):
            if f"state:{oid}:{attr}={v}" in self.ctrl.world.learned:
                return v
        return None

    # ------------------------------------------------------------------ skills composed

    def resolve(self, ref: ObjectRef | None) -> str | None:
        """The one object the instruction means, if the agent can tell."""
        if ref is None:
            return None
        cands = self.k.matching(ref)
        if not cands:
            return None
        if self.priv and ref.owner:
            cands = [c for c in cands if self.ctrl.compiled.obj[c].owner == ref.owner] or cands
        known_loc = [c for c in cands if self.k.loc(c) is not None]
        if not known_loc:
            return None
        if len(known_loc) > 1:
            here = [c for c in known_loc if self.k.place_of(c) == self.k.here]
            return (here or known_loc)[0]
        return known_loc[0]

    def find(self, ref: ObjectRef):
        """Search or ask for an object whose whereabouts are unknown."""
        k, c = self.k, self.ctrl.compiled
        q = ref.type.replace("_", " ")
        if self.priv:
            target = next((o for o in c.obj_order if c.obj[o].type == ref.type and
                           (not ref.color or c.obj[o].color == ref.color) and
                           (not ref.owner or c.obj[o].owner == ref.owner)), None)
            if target is None:
                self.m.gave_up = True
                return self.act()
            p = self.ctrl.world.place_of(target)
            if p in self.ctrl.world.known_places:
                if p != k.here:
                    return self.move_to(p, f"the {q} is in the {self._n(p)}")
                return (f"The {q} should be here; I'll search.", _call("search", query=q))
            for pid in k.people():
                if k.knows_about(pid, target) and (pid, q) not in self.m.asked:
                    return self.talk(pid, q, f"I need to know where the {q} is")
            self.m.gave_up = True
            return self.act()
        if (k.here, q) not in self.m.searched and self._needs_search(k.here):
            return (f"I don't know where the {q} is. I'll search the {self._n(k.here)} first.",
                    _call("search", query=q))
        for pid in k.people():
            if k.person_place(pid) == k.here and (pid, q) not in self.m.asked and (pid, "talk") not in self.m.refused:
                return (f"The {q} is not in the {self._n(k.here)}. {self._n(pid)} is here and may know where it is.",
                        _call("talk_to", person=pid, topic=q, message=f"Do you know where the {q} is?"))
        # the nearest person not yet asked or unsearched place; those behind a known obstacle come last
        # (reaching them means dealing with it: a key, a detour or a helper)
        def cost(place: str) -> float | None:
            return self.ctrl.world.route_cost(place, k.route)

        options = []
        for pid in k.people():
            pp = k.person_place(pid)
            if pp and (pid, q) not in self.m.asked and (pid, "talk") not in self.m.refused:
                d = cost(pp)
                if d is not None:
                    options.append((d + 0.5, "person", pid, pp))
        # places not yet visited, in the order the prompt lists them (`World.unvisited`), then visited ones with
        # closed things not yet searched for it
        w = self.ctrl.world
        options += [(d, "place", p, p) for d, p in w.unvisited(k.route) if (p, q) not in self.m.searched]
        for p in sorted(w.visited):
            if p != k.here and (p, q) not in self.m.searched and self._needs_search(p):
                d = cost(p)
                if d is not None:
                    options.append((d, "place", p, p))
        if not options:
            self.m.gave_up = True
            return self.act()
        options.sort(key=lambda t: (t[0], t[2]))
        _, kind, eid, pl = options[0]
        if kind == "person":
            return self.move_to(pl, f"I don't know where the {q} is; {self._n(eid)} may know")
        return self.move_to(pl, f"I haven't searched the {self._n(pl)} for the {q} yet")

    def _needs_search(self, place: str) -> bool:
        """Only places with closed things to look into need a search; the rest are seen on arrival."""
        c, w = self.ctrl.compiled, self.ctrl.world
        return any(c.obj[o].openable and loc == place and f"state:{o}:open=True" not in w.learned
                   for o, loc in w.known_obj.items() if o in c.obj and loc is not None)

    def reveal_here(self, oid: str):
        """The object should be here: look inside its container or search."""
        k, w = self.k, self.ctrl.world
        q = self.ctrl.compiled.obj[oid].type.replace("_", " ")
        loc = k.loc(oid)
        hidden_inside = (not w.visible(oid)) if self.priv else (not self._believed_visible(oid))
        if loc in self.ctrl.compiled.obj and hidden_inside and self.ctrl.compiled.obj[loc].openable \
                and w.known_obj.get(oid) == loc:
            return (f"The {self._n(oid)} is inside the {self._n(loc)}; I'll open it.", _call("open", target=loc))
        if (k.here, q) not in self.m.searched:
            return (f"I'll search the {self._n(k.here)} for the {q}.", _call("search", query=q))
        self.m.gave_up = True
        return self.act()

    def move_to(self, place: str, why: str, obj: str | None = None):
        """Go to a place; with `obj`, an object believed to lie in plain sight there, walk straight up to it (one
        call whose argument is the object the task names, instead of the place it is in)."""
        k = self.k
        if place == k.here:
            return None
        if place not in self.ctrl.world.known_places:
            self.m.gave_up = True
            return self.act()
        if k.route(place) is not None:
            if obj is not None and self.ctrl.world.known_obj.get(obj) == place:
                return (f"{_cap(why)}, so I'll walk up to the {self._n(obj)}.", _call("navigate", target=obj))
            return (f"{_cap(why)}, so I'll go to the {self._n(place)}.", _call("navigate", target=place))
        # commit to one obstacle until it is gone, so the planner does not wander between helpers
        ob = self.m.commit.get(place)
        if ob is None or not self._still_obstacle(ob):
            ob = self.m.commit[place] = self._first_obstacle(place)
        if ob is None or len(self._handling) > 4:
            self.m.gave_up = True
            return self.act()
        kind, eid, side = ob
        if ob in self._handling:  # resolving it needs a route through itself (the key is behind its own door)
            if kind != "locked" or eid in self.m.no_key:
                self.m.gave_up = True
                return self.act()
            self.m.no_key.add(eid)
        self._handling.add(ob)
        try:
            if kind == "locked":
                return self.unlock(eid, side)
            if kind == "blocked":
                return self.get_help("clear", eid, why=f"the {self._n(eid)} is blocked")
            return self.get_help("permission", eid, why=f"I need to enter the {self._n(eid)} for my task")
        finally:
            self._handling.discard(ob)

    def _still_obstacle(self, commit) -> bool:
        return self.k.flag(commit[0], commit[1])

    def _first_obstacle(self, place: str):
        """The first known obstacle on the known route that crosses the fewest obstacles."""
        k, w = self.k, self.ctrl.world
        start = k.here
        best = {start: 0}
        prev: dict[str, tuple[str, str]] = {}
        heap = [(0, start)]
        while heap:
            d, here = heapq.heappop(heap)
            if here == place:
                break
            if d > best.get(here, 1 << 30):
                continue
            for cid, nxt in self.ctrl.compiled.adj[here]:
                if cid not in w.known_conns or nxt not in w.known_places:
                    continue
                cost = 1 + 100 * (k.flag("locked", cid) or k.flag("blocked", cid) or k.flag("restricted", nxt))
                if d + cost < best.get(nxt, 1 << 30):
                    best[nxt] = d + cost
                    prev[nxt] = (here, cid)
                    heapq.heappush(heap, (d + cost, nxt))
        if place not in prev:
            return None
        path, node = [], place
        while node != start:
            p, cid = prev[node]
            path.append((p, cid, node))
            node = p
        for p, cid, nxt in reversed(path):
            if k.flag("locked", cid):
                return ("locked", cid, p)
            if k.flag("blocked", cid):
                return ("blocked", cid, p)
            if k.flag("restricted", nxt):
                return ("restricted", nxt, p)
        return None

    def unlock(self, cid: str, side: str):
        k, c = self.k, self.ctrl.compiled
        held = next((h for h in k.holding if c.obj[h].opens == cid), None)
        if held:
            x = c.conn[cid]
            if k.here in (x.a, x.b):
                return (f"I have the {self._n(held)}, so I'll unlock the {self._n(cid)}.", _call("open", target=cid))
            return self.move_to(side, f"I need to reach the {self._n(cid)} with the {self._n(held)}")
        keys = [o for o in c.keys_for.get(cid, []) if (k.known(o) or self.priv) and cid not in self.m.no_key]
        keys = [o for o in keys if k.place_of(o) is not None]
        if keys:
            key = keys[0]
            return self.acquire(key, why=f"the {self._n(cid)} is locked and the {self._n(key)} opens it")
        return self.get_help("unlock", cid, why=f"the {self._n(cid)} is locked and I have no key for it")

    def open_door(self, d: str):
        k, c = self.k, self.ctrl.compiled
        x = c.conn[d]
        if k.here not in (x.a, x.b):
            ends = sorted((x.a, x.b), key=lambda p: len(k.route(p) or [0] * 99))
            return self.move_to(ends[0], f"I need to be next to the {self._n(d)} to open it")
        if k.flag("locked", d):
            return self.unlock(d, k.here)
        return (f"I'm next to the {self._n(d)}; I'll open it.", _call("open", target=d))

    def get_help(self, request: str, target: str, why: str, destination: str | None = None):
        k = self.k
        opts = []
        for pid in k.people():
            if (pid, request) in self.m.refused or not k.can_help(pid, request):
                continue
            pp = k.person_place(pid)
            if pp is None:
                continue
            r = [] if pp == k.here else k.route(pp)
            if r is not None:
                opts.append((len(r), pid, pp))
        if not opts:
            self.m.gave_up = True
            return self.act()
        opts.sort()
        _, pid, pp = opts[0]
        if pp != k.here:
            return self.move_to(pp, f"{_cap(why)}; {self._n(pid)} may be able to help")
        args = dict(person=pid, request=request, target=target, reason=f"{_cap(why)}.")
        if destination:
            args["destination"] = destination
        return (f"{_cap(why)}. I'll ask {self._n(pid)} for help.", _call("ask_for_help", **args))

    def talk(self, pid: str, topic: str, why: str):
        k = self.k
        pp = k.person_place(pid)
        if pp is None:
            self.m.gave_up = True
            return self.act()
        if pp != k.here:
            return self.move_to(pp, f"{why}; {self._n(pid)} is there")
        return (f"{_cap(why)}. I'll ask {self._n(pid)}.",
                _call("talk_to", person=pid, topic=topic, message=f"Could you tell me about {topic}?"))

    def acquire(self, oid: str, why: str):
        """Get an object into the agent's hands (with every obstacle the pick-up can meet)."""
        k, c, w = self.k, self.ctrl.compiled, self.ctrl.world
        if oid in k.holding:
            return None
        p = k.place_of(oid)
        if p is None or p not in w.known_places:
            return self.find(ObjectRef(type=c.obj[oid].type, color=c.obj[oid].color, owner=c.obj[oid].owner
                                       if self.priv else None))
        if p != k.here:
            return self.move_to(p, why, obj=oid)
        if not w.visible(oid) if self.priv else not self._believed_visible(oid):
            return self.reveal_here(oid)
        # disambiguation: look at name tags once an ambiguity is known
        ref_owner = next((g.object.owner for g in self.goal if g.object and g.object.type == c.obj[oid].type
                          and g.object.owner), None)
        if ref_owner and (self.m.ambiguous_seen or (self.priv and self._ambiguous(oid))):
            same = [o for o in c.obj_order if c.obj[o].type == c.obj[oid].type and k.known(o)
                    and k.place_of(o) == k.here]
            if self.priv:
                if f"owner:{oid}={ref_owner}" not in w.learned and ("identified:" + oid) not in w.learned:
                    return (f"There are several {c.obj[oid].type}s; I'll check the name tag of the "
                            f"{self._n(oid)}.", _call("inspect", target=oid))
            else:
                unknown = [o for o in same if self.k.owner(o) is None]
                mine = [o for o in same if self.k.owner(o) == ref_owner]
                if not mine and unknown:
                    return (f"Several {c.obj[oid].type}s are here; I'll read the name tag on the "
                            f"{self._n(unknown[0])}.", _call("inspect", target=unknown[0]))
                if mine and mine[0] != oid:
                    oid = mine[0]
        if k.flag("heavy", oid):
            return None  # the caller arranges carrying
        if k.flag("fragile", oid) and k.holding:
            h = k.holding[0]
            return (f"The {self._n(oid)} is fragile and needs both hands; I'll put the {self._n(h)} down first.",
                    _call("place", object=h, target=k.here))
        if len(k.holding) >= w.capacity:
            h = next(x for x in k.holding if not c.obj[x].opens) if any(not c.obj[x].opens for x in k.holding) \
                else k.holding[0]
            return (f"My hands are full; I'll put the {self._n(h)} down.", _call("place", object=h, target=k.here))
        return (f"{_cap(why)}. The {self._n(oid)} is here; I'll pick it up.", _call("pick_up", object=oid))

    def _ambiguous(self, oid: str) -> bool:
        return any(t.kind == "ambiguous_target" and oid in t.candidates for t in self.ctrl.compiled.triggers)

    def _believed_visible(self, oid: str) -> bool:
        """From the belief alone: seen here in plain sight, on a surface, or in a container seen open."""
        c, w = self.ctrl.compiled, self.ctrl.world
        kl = w.known_obj.get(oid)
        if kl is None:
            return False
        if kl == self.k.here:
            return True
        if kl in c.obj:
            parent = c.obj[kl]
            return parent.surface or not parent.openable or f"state:{kl}:open=True" in w.learned
        return False

    def fetch(self, g: GoalStep):
        k, c, w = self.k, self.ctrl.compiled, self.ctrl.world
        oid = self.resolve(g.object)
        if oid is None:
            return self.find(g.object)
        other = None
        if g.next_to is not None:
            other = self.resolve(g.next_to)
        # done?
        loc = k.loc(oid)
        if loc is not None and loc != HELD:
            if g.container and loc == g.container:
                return None
            if g.place and not g.container and k.place_of(oid) == g.place and g.next_to is None:
                return None
            if other and (oid, other) in self.m.placed_next:
                return None
        dest_place = g.place or (k.place_of(g.container) if g.container else None)
        if oid not in k.holding:
            if k.flag("heavy", oid) and w.known_obj.get(oid) is not None:
                return self.get_help("carry", oid, why=f"the {self._n(oid)} is too heavy for me to lift",
                                     destination=g.container or g.place)
            a = self.acquire(oid, why=f"the instruction asks me to bring the {self._n(oid)}")
            if a is not None:
                return a
            if k.flag("heavy", oid):
                return self.get_help("carry", oid, why=f"the {self._n(oid)} is too heavy for me to lift",
                                     destination=g.container or g.place)
            return None
        if not (g.place or g.container or g.next_to):
            return None  # "pick up the X": holding it is the goal
        if g.next_to is not None:
            if other is None:
                return self.find(g.next_to)
            dest_place = k.place_of(other)
            if dest_place is None:
                return self.find(g.next_to)
        if dest_place is None:
            self.m.gave_up = True
            return self.act()
        if dest_place != k.here:
            return self.move_to(dest_place, f"I'm carrying the {self._n(oid)} to the {self._n(dest_place)}", obj=other)
        if other is not None:
            return (f"I'm next to the {self._n(other)}; I'll put the {self._n(oid)} beside it.",
                    _call("place", object=oid, target=other))
        if g.container:
            cont = c.obj[g.container]
            closed = (not w.obj[g.container]["open"]) if self.priv else (
                f"state:{g.container}:open=True" not in w.learned and
                (f"state:{g.container}:open=False" in w.learned or self._tried_place(oid, g.container)))
            if cont.openable and not cont.surface and closed:
                return (f"The {self._n(g.container)} is closed; I'll open it.", _call("open", target=g.container))
            return (f"I'll put the {self._n(oid)} {'on' if cont.surface else 'in'} the {self._n(g.container)}.",
                    _call("place", object=oid, target=g.container))
        return (f"I'm in the {self._n(k.here)}; I'll put the {self._n(oid)} down here.",
                _call("place", object=oid, target=k.here))

    def _tried_place(self, oid: str, container: str) -> bool:
        return self.m.tried.get(repr(_call("place", object=oid, target=container)), 0) > 0


_STATE_WORDS = {"on": {True: "on", False: "off"}, "open": {True: "open", False: "closed"},
                "locked": {True: "locked", False: "unlocked"}, "broken": {True: "broken", False: "working"}}


def _call(name: str, **arguments: str) -> dict:
    return {"name": name, "arguments": arguments}


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def solve(task, privileged: bool = True, world: World | None = None, max_steps: int | None = None):
    """Run the planner on a fresh controller; returns (controller, steps)."""
    ctrl = EnvController(task)
    ctrl.reset(world)
    planner = ExpertPlanner(ctrl, privileged=privileged)
    steps = planner.run(max_steps=max_steps)
    return ctrl, steps

