"""Runtime world: a TaskInstance compiled once into fast static tables plus a small mutable state.

The pydantic models are the boundary; stepping works on plain dicts so the sandbox runs at tens of
thousands of steps per second. `World.clone()` is cheap, which resets, validation counterfactuals
and GiGPO groups (many rollouts from one initial state) rely on.
"""

from __future__ import annotations

import hashlib
import marshal
from collections import deque
from operator import itemgetter

from sandbox.schema import FailureTrigger, HumanPersona, TaskInstance
from sandbox.text import normalize

HELD = "@agent"  # location of an object the agent holds
# every mutable field of an object, in a fixed order
_MUTABLE_FIELDS = itemgetter("loc", "next_to", "open", "locked", "on", "broken", "heavy", "fragile")


class Compiled:
    """Static tables of one task (never mutated while stepping)."""

    def __init__(self, task: TaskInstance):
        st = task.env_state
        self.task = task
        self.place = {p.id: p for p in st.places}
        self.conn = {c.id: c for c in st.connections}
        self.obj = {o.id: o for o in st.objects}
        self.obj_order = [o.id for o in st.objects]
        self.person = {p.id: p for p in st.people}
        self.person_order = [p.id for p in st.people]
        self.fact = {f.id: f for f in st.facts}
        self.persona: dict[str, HumanPersona] = {h.person: h for h in task.human_persona}
        self.adj: dict[str, list[tuple[str, str]]] = {p: [] for p in self.place}
        for c in st.connections:
            self.adj[c.a].append((c.id, c.b))
            self.adj[c.b].append((c.id, c.a))
        self.triggers: list[FailureTrigger] = list(task.failure_triggers)
        self.trigger_by: dict[tuple[str, str], FailureTrigger] = {(t.kind, t.target): t for t in self.triggers}
        # hidden places/doors -> the person_knowledge trigger whose reveal puts them on the map
        self.hidden_trigger: dict[str, str] = {}
        for t in self.triggers:
            if t.kind == "person_knowledge":
                for h in task.human_persona:
                    for hid in h.reveals.get(t.target, []):
                        self.hidden_trigger[hid] = t.id
        self.keys_for: dict[str, list[str]] = {}
        for o in st.objects:
            if o.opens:
                self.keys_for.setdefault(o.opens, []).append(o.id)
        self.locks_visible = st.locks_visible
        self.view_people = {p.id for p in task.agent_view.people}
        # fixtures never move: index them by place; only portable objects need the containment walk
        self.fixtures_at: dict[str, list[str]] = {p: [] for p in self.place}
        self.portable: list[str] = []
        for o in st.objects:
            if not o.portable and o.location in self.place:
                self.fixtures_at[o.location].append(o.id)
            else:
                self.portable.append(o.id)
        # static text pieces of observations, built once per task
        self.label = {o.id: f"{o.name} [{o.id}]" for o in st.objects}
        self.label.update({p.id: f"{p.name} [{p.id}]" for p in st.people})
        self.inside_text = {o.id: f" {'on' if o.surface else 'in'} the {o.name}" for o in st.objects}
        self.here_text = {p.id: f"You are in the {p.name} [{p.id}]." for p in st.places}
        self.exit_text = {p: [(cid, f"{self.place[nxt].name} [{nxt}] via {cid}") for cid, nxt in self.adj[p]]
                          for p in self.place}
        self.fixture_place = {o: p for p, ids in self.fixtures_at.items() for o in ids}
        self.norm_names = {o.id: (normalize(o.type), normalize(o.name)) for o in st.objects}
        self.open_facts = {o.id: (f"state:{o.id}:open=True", f"state:{o.id}:open=False") for o in st.objects}
        self.closable = {o.id for o in st.objects if o.openable and not o.surface}
        self.openable_fixtures_at = {p: [o for o in ids if self.obj[o].openable] for p, ids in self.fixtures_at.items()}
        self.initial = World.from_task(self)
        # (world after the first look, its observation, subgoals met at reset)
        self.reset_cache: tuple[World, str, list[str]] | None = None
        self.initial.state_key()  # computed once; every reset's clone inherits it

    def display_name(self, eid: str) -> str:
        """How observations name an object, place, person or connection ("blue door between hall and kitchen")."""
        if eid in self.obj:
            return self.obj[eid].name
        if eid in self.place:
            return self.place[eid].name
        if eid in self.person:
            return self.person[eid].name
        if eid in self.conn:
            x = self.conn[eid]
            return f"{x.color + ' ' if x.color else ''}{x.kind} between {self.place[x.a].name} and " \
                   f"{self.place[x.b].name}"
        return eid

    def trigger_id(self, kind: str, target: str) -> str | None:
        """The id of the task's failure trigger of this kind on this target, if there is one."""
        t = self.trigger_by.get((kind, target))
        return t.id if t else None


class World:
    """Mutable state: what the world is, and what the agent knows of it (its belief)."""

    __slots__ = ("c", "agent_place", "agent_near", "holding", "capacity", "obj", "door", "blocked", "restricted",
                 "hidden", "person_place", "asks", "helped", "known_places", "known_conns", "known_obj",
                 "known_door", "known_person", "visited", "learned", "notes", "reports", "finished", "latched", "_key",
                 "_sorted_cache", "_routes", "_obj_canon")

    def __init__(self, c: Compiled):
        self.c = c
        self._key: str | None = None
        self._sorted_cache: dict[str, tuple] = {}
        self._obj_canon: bytes | None = None   # digest of the slow-changing parts of the state
        self._routes: dict[tuple, list | None] = {}

    @classmethod
    def from_task(cls, c: Compiled) -> "World":
        task, st = c.task, c.task.env_state
        w = cls(c)
        w.agent_place = st.agent.place
        w.agent_near = None
        w.holding = list(st.agent.holding)
        w.capacity = st.agent.capacity
        w.obj = {o.id: {"loc": HELD if o.id in st.agent.holding else o.location, "next_to": o.next_to,
                        "open": o.open, "locked": o.locked, "on": o.on, "broken": o.broken, "heavy": o.heavy,
                        "fragile": o.fragile} for o in st.objects}
        w.door = {x.id: x.door for x in st.connections}
        w.blocked = {x.id: x.blocked for x in st.connections}
        w.restricted = {p.id: p.restricted for p in st.places}
        w.hidden = {p.id for p in st.places if p.hidden} | {x.id for x in st.connections if x.hidden}
        w.person_place = {p.id: p.place for p in st.people}
        w.asks = {p.id: 0 for p in st.people}
        w.helped = set()
        view = task.agent_view
        w.known_places = {p.id for p in view.places}
        w.known_conns = {x.id for x in view.connections}
        w.known_door = {x.id: x.door for x in view.connections}
        w.known_obj = {o.id: o.last_seen for o in view.objects}
        w.known_obj.update({h: HELD for h in st.agent.holding})
        w.known_person = {p.id: p.last_seen for p in view.people}
        w.visited = set()  # places the agent has stood in and looked at (the first look adds the start)
        w.learned = set()
        w.notes = {}
        w.reports = []
        w.finished = False
        w.latched = 0
        return w

    def clone(self) -> "World":
        w = World.__new__(World)
        w.c = self.c
        w.agent_place, w.agent_near, w.capacity = self.agent_place, self.agent_near, self.capacity
        w.holding = list(self.holding)
        w.obj = {k: v.copy() for k, v in self.obj.items()}
        w.door, w.blocked, w.restricted = dict(self.door), dict(self.blocked), dict(self.restricted)
        w.hidden = set(self.hidden)
        w.person_place, w.asks, w.helped = dict(self.person_place), dict(self.asks), set(self.helped)
        w.known_places, w.known_conns = set(self.known_places), set(self.known_conns)
        w.known_door, w.known_obj = dict(self.known_door), dict(self.known_obj)
        w.known_person, w.visited = dict(self.known_person), set(self.visited)
        w.learned, w.reports, w.notes = set(self.learned), list(self.reports), dict(self.notes)
        w.finished, w.latched, w._key = self.finished, self.latched, self._key
        w._sorted_cache = dict(self._sorted_cache)
        w._obj_canon = self._obj_canon
        w._routes = dict(self._routes)
        return w

    # ------------------------------------------------------------------ canonical state

    def touch(self) -> None:
        """The state may have changed: the key is recomputed on next use (object states are assumed same)."""
        self._key = None

    def touch_objects(self) -> None:
        """Objects, people, restrictions or hidden places may have changed too (pick, place, open, operate, a
        person answering or acting, a counterfactual)."""
        self._key = None
        self._obj_canon = None

    def uncached_key(self) -> str:
        """The state key computed from scratch, with every cache dropped (tests check the caches with it)."""
        w = self.clone()
        w._key, w._obj_canon, w._sorted_cache = None, None, {}
        return w.state_key()

    def _sorted(self, name: str, items) -> tuple:
        """Sorted tuple of a set that only grows (known_places, visited, helped) or only shrinks (hidden): its length is
        its version, so the sort is redone only when it changed."""
        cached = self._sorted_cache.get(name)
        if cached is None or cached[0] != len(items):
            cached = self._sorted_cache[name] = (len(items), tuple(sorted(items)))
        return cached[1]

    def _slow_digest(self) -> bytes:
        """Digest of the parts that only some skills change (objects, restrictions, hidden places, people,
        help given, blocked paths); kept until `touch_objects()`."""
        if self._obj_canon is None:
            slow = (tuple(map(_MUTABLE_FIELDS, self.obj.values())),   # dict order is the task's object order
                    tuple(self.blocked.values()), tuple(self.restricted.values()),
                    self._sorted("hidden", self.hidden), tuple(self.person_place.values()),
                    tuple(self.asks.values()), self._sorted("helped", self.helped))
            self._obj_canon = hashlib.blake2b(marshal.dumps(slow, 2), digest_size=16).digest()
        return self._obj_canon

    def state_key(self) -> str:
        """Stable hash of what matters: agent, holdings, object/door/NPC states, revealed facts, progress."""
        if self._key is None:
            canon = (
                self.agent_place, self.agent_near, tuple(self.holding), self._slow_digest(),
                tuple(self.door.values()), tuple(sorted(self.learned)),
                # fixtures never move, so only portable objects' believed positions can differ
                tuple(map(self.known_obj.get, self.c.portable)),
                tuple(map(self.known_person.get, self.c.person_order)),
                self._sorted("known_places", self.known_places), self._sorted("visited", self.visited),
                self.reports[-1] if self.reports else None,
                self.latched, self.finished,
            )
            # marshal version 2 has no back-references, so equal tuples give equal bytes in every process
            self._key = hashlib.blake2b(marshal.dumps(canon, 2), digest_size=8).hexdigest()
        return self._key

    # ------------------------------------------------------------------ geometry

    def place_of(self, obj_id: str) -> str:
        """The place an object is in (following containers); the agent's place if held."""
        loc = self.obj[obj_id]["loc"]
        for _ in range(16):
            if loc == HELD:
                return self.agent_place
            if loc in self.c.place:
                return loc
            loc = self.obj[loc]["loc"]
        return loc

    def visible(self, obj_id: str) -> bool:
        """In plain sight at the agent's place: not held, not inside a closed container."""
        loc = self.obj[obj_id]["loc"]
        if loc == HELD:
            return False
        for _ in range(16):
            if loc in self.c.place:
                return loc == self.agent_place
            if loc == HELD:  # inside something the agent carries
                return False
            parent = self.c.obj[loc]
            if parent.openable and not parent.surface and not self.obj[loc]["open"]:
                return False
            loc = self.obj[loc]["loc"]
        return False

    def reachable_inside(self, obj_id: str) -> bool:
        """Here, possibly inside a closed but unlocked container (what `search` can find)."""
        loc = self.obj[obj_id]["loc"]
        if loc == HELD:
            return False
        for _ in range(16):
            if loc in self.c.place:
                return loc == self.agent_place
            if loc == HELD:
                return False
            if self.obj[loc]["locked"]:
                return False
            loc = self.obj[loc]["loc"]
        return False

    def known_passable(self, conn_id: str) -> bool:
        """Whether the agent believes it can go through a connection."""
        ln = self.learned
        return ("locked:" + conn_id) not in ln and ("blocked:" + conn_id) not in ln

    # Obstacle facts go through learn/unlearn so the route cache stays right.
    def learn(self, fact: str) -> None:
        if fact not in self.learned:
            self.learned.add(fact)
            self._routes.clear()

    def unlearn(self, fact: str) -> None:
        if fact in self.learned:
            self.learned.discard(fact)
            self._routes.clear()

    def known_route(self, start: str, goal: str, avoid_obstacles: bool = True,
                    extra: frozenset[str] | None = None) -> list[tuple[str, str]] | None:
        """Shortest route over the agent's known map: [(connection, next place), ...].

        With `avoid_obstacles`, connections and places the agent knows to be impassable are avoided, and so
        are the ids in `extra` (the oracle passes the true obstacles). Results are cached until the known map
        grows or an obstacle fact changes.
        """
        if start == goal:
            return []
        kc, kp, ln = self.known_conns, self.known_places, self.learned
        key = (start, goal, avoid_obstacles, len(kc), len(kp))
        if extra is None and key in self._routes:
            return self._routes[key]
        prev: dict[str, tuple[str, str] | None] = {start: None}
        q = deque([start])
        found = None
        while q and found is None:
            here = q.popleft()
            for cid, nxt in self.c.adj[here]:
                if cid not in kc or nxt not in kp or nxt in prev:
                    continue
                if avoid_obstacles and (not self.known_passable(cid) or
                                        (("restricted:" + nxt) in ln and ("permit:" + nxt) not in ln) or
                                        (extra is not None and (cid in extra or nxt in extra))):
                    continue
                prev[nxt] = (here, cid)
                if nxt == goal:
                    path, node = [], goal
                    while prev[node] is not None:
                        p, c = prev[node]
                        path.append((c, node))
                        node = p
                    found = path[::-1]
                    break
                q.append(nxt)
        if extra is None:
            self._routes[key] = found
        return None if found is None else list(found)

    def route_cost(self, goal: str, route=None) -> int | None:
        """How far `goal` is for the agent: the length of the shortest known route that avoids known obstacles, or
        100 plus the length of one through them (going there means dealing with an obstacle first); None with no
        known route. `route(goal, avoid)` replaces the known-map route (the oracle expert avoids true obstacles)."""
        if route is None:
            def route(g: str, avoid: bool):
                return self.known_route(self.agent_place, g, avoid_obstacles=avoid)
        r = route(goal, True)
        if r is not None:
            return len(r)
        r = route(goal, False)
        return None if r is None else 100 + len(r)

    def unvisited(self, route=None) -> list[tuple[int, str]]:
        """Known places the agent has not been in, nearest first: `(cost, place)` sorted by `route_cost` then id
        (places with no known route are left out). This one order is what the prompt shows and what the teacher
        explores by, so the student can read the teacher's next exploration step off its prompt.
        """
        out = []
        for p in self._sorted("known_places", self.known_places):
            if p in self.visited or p == self.agent_place:
                continue
            d = self.route_cost(p, route)
            if d is not None:
                out.append((d, p))
        out.sort()
        return out
