"""The policy side of pixel evaluation: a belief built from perceived frames only, rendered in the sandbox's own
text format, and a skill executor that turns sandbox skill calls into MiniGrid's primitive actions by planning
over that belief (never over the environment).

- `GridBelief` keeps the last-seen content of every cell, the agent's pose, the objects it has seen (ids as the
  sandbox's rooms scene names them, colour and type: `red_ball`, `red_ball_2` for a second look-alike), what it
  holds and the rooms it has stood in. Rooms come from the walls: connected floor regions, named like the
  sandbox's rooms scene (`room_<row>_<col>`, "north-west room" in a 3x3 grid); doors are named
  `<colour>_door_<room>_<room>`. `known()` is the sandbox's known-map dict, so `agent.prompt.build_step_messages`
  renders it unchanged and a sandbox-trained student reads the same prompt.
- `SkillExecutor` runs one call at a time as a generator of primitive actions that re-plans on every frame
  (closed loop), and ends with an `Outcome` worded like the sandbox's observations and errors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generator

import numpy as np

from evaluation.perception import CARRYABLE, COLORS, DIR_VEC, STATES, TYPE_IDX, TYPES, Percept
from sandbox.skills import CallError, check_call, described_id

# MiniGrid's primitive actions
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
_WALL, _DOOR = TYPE_IDX["wall"], TYPE_IDX["door"]
_CARRY = {TYPE_IDX[t] for t in CARRYABLE}
_WALKABLE = {TYPE_IDX[t] for t in ("empty", "floor", "goal", "unseen")}


def room_name(row: int, col: int, rows: int, cols: int) -> str:
    """Compass names as in the sandbox's rooms scene ("north-west room", "centre room"); "room" when alone."""
    def part(i: int, n: int, lo: str, hi: str) -> str:
        return "" if n == 1 or (n == 3 and i == 1) else lo if i == 0 else hi if i == n - 1 else ""

    v, h = part(row, rows, "north", "south"), part(col, cols, "west", "east")
    if rows == cols == 1:
        return "room"
    if not v and not h:
        return "centre room"
    return f"{v}-{h} room" if v and h else f"{v or h} room"


@dataclass
class Obj:
    oid: str
    type: str
    color: str
    pos: tuple[int, int] | None  # None: held, or gone from where it was last seen

    @property
    def name(self) -> str:
        return f"{self.color} {self.type}"


@dataclass
class Outcome:
    ok: bool
    text: str
    error: str | None = None
    finish: bool = False


def regions_of(mask: np.ndarray) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """The 4-connected regions of the True cells of `mask` ([x, y]): a label per cell (-1 outside) and each
    region's cells, regions numbered in the order of their first cell (x, then y)."""
    w, h = mask.shape
    label = -np.ones((w, h), dtype=np.int64)
    regions: list[list[tuple[int, int]]] = []
    for sx, sy in zip(*np.nonzero(mask), strict=True):
        if label[sx, sy] >= 0:
            continue
        q, region = deque([(int(sx), int(sy))]), []
        label[sx, sy] = len(regions)
        while q:
            cx, cy = q.popleft()
            region.append((cx, cy))
            for dx, dy in DIR_VEC:
                nx, ny = cx + dx, cy + dy
                if 0 <= nx < w and 0 <= ny < h and mask[nx, ny] and label[nx, ny] < 0:
                    label[nx, ny] = len(regions)
                    q.append((nx, ny))
        regions.append(region)
    return label, regions


class GridBelief:
    """What the agent knows, from percepts alone (see the module docstring). In `topdown` every cell of the frame
    counts as seen; in `topdown-fov` the walls and doors of the whole frame form the map (as the sandbox's map is
    known from the start) but objects count only inside the highlighted field of view. First-person frames are
    read by the subclass `evaluation.egocentric.EgoBelief`."""

    def __init__(self, view: str = "topdown"):
        if view not in ("topdown", "topdown-fov"):
            raise ValueError(f"GridBelief reads top-down frames (topdown, topdown-fov), not {view!r}")
        self.view = view
        self.cells: np.ndarray | None = None
        self.pose: tuple[int, int, int] | None = None
        self.objects: dict[str, Obj] = {}
        self.at: dict[tuple[int, int], str] = {}
        self.holding: str | None = None
        self.visited: set[str] = set()
        self.room_of: np.ndarray | None = None
        self.rooms: list[tuple[str, str]] = []
        self.room_cells: dict[str, list[tuple[int, int]]] = {}
        self.doors: dict[str, dict] = {}
        self.door_at: dict[tuple[int, int], str] = {}
        self.place: str | None = None
        self.seen_now: set[str] = set()

    # ------------------------------------------------------------------ reading frames

    def update(self, p: Percept, last_action: int | None = None) -> None:
        first = self.cells is None
        cells = p.cells.copy()
        observed = np.ones(cells.shape[:2], dtype=bool) if self.view == "topdown" else p.visible.copy()
        if first:
            self.cells = cells.copy()
            # outside the field of view only the structure counts: other cells are unseen (walkable until seen)
            structure = np.isin(cells[:, :, 0], (_WALL, _DOOR))
            self.cells[~observed & ~structure] = (TYPE_IDX["unseen"], 0, 0)
            self._segment()
        prev_pose = self.pose
        if p.agent is not None:
            self.pose = p.agent
        front = self.front(prev_pose) if prev_pose else None
        # the structure (walls, doors and their states) is read from the whole frame
        for pos, did in self.door_at.items():
            if cells[pos][0] == _DOOR:
                self.doors[did]["state"] = STATES[int(cells[pos][2])]
        w, h = cells.shape[:2]
        self.track_objects([((x, y), cells[x, y]) for x in range(w) for y in range(h) if observed[x, y]],
                           last_action, front)
        for x in range(w):
            for y in range(h):
                if observed[x, y] or (x, y) in self.at:
                    self.cells[x, y] = cells[x, y]
                elif cells[x, y][0] in (_WALL, _DOOR):
                    self.cells[x, y] = cells[x, y]
        if self.pose is not None:
            r = self.room_at(self.pose[:2])
            if r is not None:
                self.place = r
                self.visited.add(r)

    def track_objects(self, seen, last_action: int | None, front) -> None:
        """Object identity across frames, from the cells seen now ((cell, encoding) pairs): an object seen where
        the same kind was seen keeps its id; one that vanished from the cell ahead after a pick-up is held; the
        held object reappearing ahead after a drop is the same object; anything else new gets a new id (`red_ball`,
        then `red_ball_2`)."""
        self.seen_now = set()
        for (x, y), enc in seen:
            t, c = int(enc[0]), int(enc[1])
            oid = self.at.get((x, y))
            if t in _CARRY:
                if oid is not None and self.objects[oid].type == TYPES[t] and self.objects[oid].color == COLORS[c]:
                    self.seen_now.add(oid)
                    continue
                if oid is not None:  # a different object stands where another was seen
                    self.objects[oid].pos = None
                held = self.objects.get(self.holding) if self.holding else None
                if (last_action == DROP and held is not None and front == (x, y) and held.type == TYPES[t]
                        and held.color == COLORS[c]):
                    new = held
                    self.holding = None
                else:
                    # the sandbox's `rooms` ids: colour and type, numbered only for a look-alike
                    new = Obj(described_id(COLORS[c], TYPES[t], self.objects), TYPES[t], COLORS[c], None)
                    self.objects[new.oid] = new
                new.pos = (x, y)
                self.at[(x, y)] = new.oid
                self.seen_now.add(new.oid)
            elif oid is not None:  # the object is no longer there
                del self.at[(x, y)]
                self.objects[oid].pos = None
                if last_action == PICKUP and front == (x, y) and self.holding is None:
                    self.holding = oid

    def _segment(self) -> None:
        """Rooms are the 4-connected regions of non-wall, non-door cells; doors join the regions on either side."""
        cells = self.cells
        w, h = cells.shape[:2]
        label, regions = regions_of(~np.isin(cells[:, :, 0], (_WALL, _DOOR)))
        # rows and columns of rooms from the regions' top-left corners
        tops = sorted({min(y for _, y in r) for r in regions})
        lefts = sorted({min(x for x, _ in r) for r in regions})
        names = []
        for r in regions:
            row, col = tops.index(min(y for _, y in r)), lefts.index(min(x for x, _ in r))
            names.append((f"room_{row}_{col}", room_name(row, col, len(tops), len(lefts))))
        self.room_of = label
        self.rooms = sorted(set(names))
        self.room_cells = {names[i][0]: regions[i] for i in range(len(regions))}
        self._room_ids = [n for n, _ in names]
        for x in range(w):
            for y in range(h):
                if cells[x, y][0] != _DOOR:
                    continue
                sides = sorted({self._room_ids[label[x + dx, y + dy]] for dx, dy in DIR_VEC
                                if 0 <= x + dx < w and 0 <= y + dy < h and label[x + dx, y + dy] >= 0})
                color = COLORS[int(cells[x, y][1])]
                did = f"{color}_door_" + "_".join(sides)
                while did in self.doors:  # two same-coloured doors between the same rooms: keep ids unique
                    did += "_b"
                self.doors[did] = {"pos": (x, y), "color": color, "rooms": sides,
                                   "state": STATES[int(cells[x, y][2])]}
                self.door_at[(x, y)] = did

    # ------------------------------------------------------------------ queries

    def room_at(self, pos) -> str | None:
        i = int(self.room_of[pos[0], pos[1]])
        return self._room_ids[i] if i >= 0 else None

    def front(self, pose=None) -> tuple[int, int]:
        x, y, d = pose or self.pose
        return x + DIR_VEC[d][0], y + DIR_VEC[d][1]

    def front_oid(self) -> str | None:
        return self.at.get(self.front())

    def known_objects(self) -> list[Obj]:
        return [o for o in self.objects.values() if o.pos is not None or o.oid == self.holding]

    def room_of_obj(self, oid: str) -> str | None:
        o = self.objects[oid]
        return "held" if oid == self.holding else self.room_at(o.pos) if o.pos else None

    def passable(self, pos, goal=None) -> bool:
        """Can the agent walk onto `pos`: floor, open or closed (it opens on the way) doors; not walls, locked doors,
        objects, lava or cells no template explained."""
        if pos == goal:
            return True
        w, h = self.cells.shape[:2]
        x, y = pos
        if not (0 <= x < w and 0 <= y < h) or pos in self.at:
            return False
        t, _, s = (int(v) for v in self.cells[x, y])
        if t == _DOOR:
            return STATES[s] != "locked"
        return t in _WALKABLE

    def path(self, goals: set, start=None, avoid: set = frozenset()) -> list[tuple[int, int]] | None:
        """Shortest walk (cells, start first) from the agent to any goal cell, or None."""
        start = start or self.pose[:2]
        if start in goals:
            return [start]
        prev = {start: None}
        q = deque([start])
        while q:
            cur = q.popleft()
            for dx, dy in DIR_VEC:
                nxt = (cur[0] + dx, cur[1] + dy)
                if nxt in prev or nxt in avoid or not self.passable(nxt):
                    continue
                prev[nxt] = cur
                if nxt in goals:
                    out = [nxt]
                    while prev[out[-1]] is not None:
                        out.append(prev[out[-1]])
                    return out[::-1]
                q.append(nxt)
        return None

    def distance(self, goals: set) -> int | None:
        p = self.path(goals)
        return None if p is None else len(p) - 1

    def stand_cells(self, target) -> set:
        """Cells from which the agent faces `target`: its 4 neighbours that the agent can stand on (a doorway too)."""
        return {(target[0] + dx, target[1] + dy) for dx, dy in DIR_VEC if self.passable((target[0] + dx,
                                                                                        target[1] + dy))}

    def unvisited(self) -> list[str]:
        """Rooms not stood in yet, nearest first by walking distance (ties by id), as the sandbox orders them."""
        out = []
        for rid, _ in self.rooms:
            if rid in self.visited:
                continue
            d = self.distance(set(self.room_cells[rid]))
            out.append((d if d is not None else 10_000, rid))
        return [r for _, r in sorted(out)]

    # ------------------------------------------------------------------ the sandbox's text format

    def known(self) -> dict:
        objs = []
        for o in sorted(self.known_objects(), key=lambda o: o.oid):
            objs.append((o.oid, o.name, self.room_of_obj(o.oid)))
        conns = [(did, d["rooms"][0], d["rooms"][-1], d["state"]) for did, d in sorted(self.doors.items())]
        return {"place": self.place, "holding": [self.holding] if self.holding else [], "places": list(self.rooms),
                "landmarks": {}, "connections": conns, "unvisited": self.unvisited(), "objects": objs,
                "people": [], "facts": []}

    def describe(self) -> str:
        """The observation of the current room, worded like the sandbox's."""
        name = dict(self.rooms)[self.place]
        parts = [f"You are in the {name} [{self.place}]."]
        here = [o for o in self.known_objects() if o.pos is not None and self.room_at(o.pos) == self.place and
                (self.view == "topdown" or o.oid in self.seen_now)]
        if here:
            parts.append("You see: " + ", ".join(f"{o.name} [{o.oid}]" for o in sorted(here, key=lambda o: o.oid))
                         + ".")
        names = dict(self.rooms)
        exits = [f"{names[other]} [{other}] via {did} ({d['state']})" for did, d in sorted(self.doors.items())
                 if self.place in d["rooms"] for other in d["rooms"] if other != self.place]
        if exits:
            parts.append("Exits: " + "; ".join(exits) + ".")
        if self.holding:
            parts.append(f"Holding: {self.objects[self.holding].name} [{self.holding}].")
        return " ".join(parts)


# ----------------------------------------------------------------------------- the skill executor


def _turns(d: int, want: int) -> list[int]:
    diff = (want - d) % 4
    return [] if diff == 0 else [RIGHT] if diff == 1 else [LEFT] if diff == 3 else [RIGHT, RIGHT]


def _dir_to(a, b) -> int:
    return DIR_VEC.index((b[0] - a[0], b[1] - a[1]))


SkillRun = Generator[int, None, Outcome]


@dataclass
class SkillExecutor:
    """Runs sandbox skill calls as primitive actions over a `GridBelief` (module docstring). `start(call)` returns
    a generator that yields actions and returns an `Outcome`; the caller updates the belief from the next frame
    between yields."""

    b: GridBelief
    max_actions: int = 200

    def start(self, call) -> SkillRun:
        checked = check_call(call)
        if isinstance(checked, CallError):
            return self._fail(checked.code, checked.text)
        name, args = checked
        run = getattr(self, "_do_" + name, None)
        if run is None:
            return self._fail("unsupported", f"There is no {name} here: nobody to talk to and nothing to operate.")
        return run(**args)

    @staticmethod
    def _fail(code: str, text: str) -> SkillRun:
        return Outcome(False, text, code)
        yield  # makes this a generator

    def _resolve(self, eid: str) -> tuple[str, tuple[int, int]] | None:
        """(kind, cell) of a known id: an object where last seen, a door, or a room's centre-most free cell."""
        b = self.b
        if eid in b.objects and b.objects[eid].pos is not None:
            return "object", b.objects[eid].pos
        if eid in b.doors:
            return "door", b.doors[eid]["pos"]
        if eid in b.room_cells:
            cells = b.room_cells[eid]
            cx = sum(x for x, _ in cells) / len(cells)
            cy = sum(y for _, y in cells) / len(cells)
            free = [c for c in cells if b.passable(c) and c not in b.door_at]
            return "room", min(free or cells, key=lambda c: ((c[0] - cx) ** 2 + (c[1] - cy) ** 2, c))
        return None

    def _walk(self, goals: set, face=None) -> SkillRun:
        """Walk to any goal cell (opening closed doors on the way), then turn to face `face` if given. Re-plans on
        every frame; None when there, else the failure."""
        b = self.b
        for _ in range(self.max_actions):
            pos, d = b.pose[:2], b.pose[2]
            if pos in goals:
                if face is None or b.front() == face:
                    return None
                if abs(face[0] - pos[0]) + abs(face[1] - pos[1]) == 1:
                    yield _turns(d, _dir_to(pos, face))[0]
                    continue
                return Outcome(False, "You cannot face it from here.", "unreachable")
            route = b.path(goals)
            if route is None:
                locked = [did for did, x in b.doors.items() if x["state"] == "locked"]
                why = f" (locked: {', '.join(sorted(locked))})" if locked else ""
                return Outcome(False, f"You know no free way there{why}.", "unreachable")
            nxt = route[1]
            want = _dir_to(pos, nxt)
            if want != d:
                yield _turns(d, want)[0]
                continue
            t, _, s = (int(v) for v in b.cells[nxt])
            if t == _DOOR and STATES[s] == "closed":
                yield TOGGLE
                continue
            yield FORWARD
        return Outcome(False, "You could not get there in time.", "unreachable")

    def _scan(self) -> SkillRun:
        if self.b.view != "topdown":
            for _ in range(4):
                yield LEFT

    def _do_navigate(self, target: str) -> SkillRun:
        b = self.b
        hit = self._resolve(target)
        if hit is None:
            return Outcome(False, f"You don't know any place or object called {target[:40]!r}.", "unknown_entity")
        kind, cell = hit
        if target == b.holding:
            return Outcome(False, f"You are holding the {b.objects[target].name}.", "precondition_unmet")
        if kind == "room":
            # to a room's centre, where one look around shows all of it (from a corner, a 7x7 view misses cells)
            bad = yield from self._walk({cell})
            if bad:
                return bad
            yield from self._scan()
            return Outcome(True, b.describe())
        bad = yield from self._walk(b.stand_cells(cell), face=cell)
        if bad:
            return bad
        what = b.objects[target].name if kind == "object" else target
        return Outcome(True, f"You stand next to the {what}. " + b.describe())

    def _do_look_around(self) -> SkillRun:
        yield from self._scan()
        return Outcome(True, self.b.describe())

    def frontier(self) -> set:
        """Seen floor cells of the current room next to a cell never seen: where more of the room shows."""
        b = self.b
        w, h = b.cells.shape[:2]
        return {c for c in b.room_cells.get(b.place, []) if c not in b.at and any(
            0 <= c[0] + dx < w and 0 <= c[1] + dy < h and int(b.cells[c[0] + dx, c[1] + dy][0]) == TYPE_IDX["unseen"]
            for dx, dy in DIR_VEC)}

    def _do_search(self, query: str) -> SkillRun:
        """Look around; where part of the room was never seen (first-person frames), walk to the nearest such
        edge and look again, until the whole room has been seen or no edge can be reached."""
        b = self.b
        yield from self._scan()
        tried: set = set()
        while b.view == "egocentric":
            edge = self.frontier() - tried
            route = b.path(edge) if edge else None
            if route is None:
                break
            tried.add(route[-1])
            bad = yield from self._walk({route[-1]})
            if bad:
                break
            yield from self._scan()
        q = query.lower()
        found = [o for o in b.known_objects() if o.pos is not None and b.room_at(o.pos) == b.place and
                 (q in o.name or o.type in q or q == o.oid)]
        if not found:
            return Outcome(True, f"You search the {dict(b.rooms)[b.place]} but find no {query[:40]}.")
        return Outcome(True, "You find: " + ", ".join(f"{o.name} [{o.oid}]" for o in found) + ".")

    def _do_inspect(self, target: str) -> SkillRun:
        b = self.b
        if target in b.doors:
            return Outcome(True, f"The {target} is {b.doors[target]['state']}.")
        if target in b.objects and b.objects[target].pos is not None:
            return Outcome(True, f"It is a {b.objects[target].name}.")
        return Outcome(False, f"You don't know any object called {target[:40]!r}.", "unknown_entity")
        yield  # noqa

    def _here(self, oid: str, verb: str) -> Outcome | None:
        b = self.b
        if oid not in b.objects:
            return Outcome(False, f"You don't know any object called {oid[:40]!r}.", "unknown_entity")
        o = b.objects[oid]
        if oid != b.holding and (o.pos is None or (b.room_at(o.pos) != b.place and b.front() != o.pos)):
            return Outcome(False, f"The {o.name} is not within reach here; you cannot {verb} it.",
                           "precondition_unmet")
        return None

    def _do_pick_up(self, object: str) -> SkillRun:  # noqa: A002 — the skill's argument name
        b = self.b
        bad = self._here(object, "pick up")
        if bad:
            return bad
        o = b.objects[object]
        if b.holding == object:
            return Outcome(False, f"You already hold the {o.name}.", "precondition_unmet")
        if b.holding:
            return Outcome(False, f"Your hands are full: you hold the {b.objects[b.holding].name}.",
                           "precondition_unmet")
        bad = yield from self._walk(b.stand_cells(o.pos), face=o.pos)
        if bad:
            return bad
        yield PICKUP
        if b.holding != object:
            return Outcome(False, f"You could not pick up the {o.name}.", "precondition_unmet")
        return Outcome(True, f"You pick up the {o.name}.")

    def _drop_cells(self, around) -> set:
        b = self.b
        near_door = {(x + dx, y + dy) for x, y in b.door_at for dx, dy in DIR_VEC}
        return {c for c in around if b.passable(c) and c not in b.door_at and c not in near_door and
                b.room_at(c) == b.place and c != b.pose[:2]}

    def _do_place(self, object: str, target: str) -> SkillRun:  # noqa: A002
        b = self.b
        if b.holding != object:
            what = b.objects[object].name if object in b.objects else repr(object[:40])
            return Outcome(False, f"You are not holding the {what}.", "precondition_unmet")
        o = b.objects[object]
        if target == b.place:
            # out of the way: against a wall, away from doors (a spot in mid-room can block a way)
            spots = self._drop_cells(b.room_cells[b.place])
            walls = {c for c in spots if any(int(b.cells[c[0] + dx, c[1] + dy][0]) == _WALL for dx, dy in DIR_VEC)}
            spots = [walls, spots]
            text = f"You put the {o.name} down in the {dict(b.rooms)[b.place]}."
        elif target in b.objects and target != object:
            bad = self._here(target, "put something next to")
            if bad:
                return bad
            t = b.objects[target].pos
            around = {(t[0] + dx, t[1] + dy) for dx, dy in DIR_VEC}
            # preferred: spots away from doors; else any free one next to it (the agent's own cell included)
            spots = [self._drop_cells(around), {c for c in around if b.passable(c) and c not in b.door_at and
                                                b.room_at(c) == b.place}]
            text = f"You put the {o.name} next to the {b.objects[target].name}."
        elif target in b.doors:
            bad = self._door_here(target, "put something next to")
            if bad:
                return bad
            t = b.doors[target]["pos"]
            spots = [{c for c in ((t[0] + dx, t[1] + dy) for dx, dy in DIR_VEC) if b.passable(c) and
                      b.room_at(c) == b.place}]
            text = f"You put the {o.name} next to the {target}."
        else:
            return Outcome(False, f"You can put the {o.name} in this room ({b.place}) or next to an object or door "
                                  f"here, not at {target[:40]!r}.", "bad_argument_value")
        # stand next to a free spot, facing it, and drop: the nearest spot of the first kind that has a reachable one
        best = None
        for kind in spots:
            for spot in sorted(kind):
                stands = {c for c in b.stand_cells(spot) if c != spot}
                d = b.distance(stands) if stands else None
                if d is not None and (best is None or d < best[0]):
                    best = (d, spot, stands)
            if best is not None:
                break
        if best is None:
            return Outcome(False, f"There is no free spot to put the {o.name} there.", "precondition_unmet")
        _, spot, stands = best
        bad = yield from self._walk(stands, face=spot)
        if bad:
            return bad
        yield DROP
        if b.holding == object:
            return Outcome(False, f"You could not put the {o.name} down.", "precondition_unmet")
        return Outcome(True, text)

    def _door_here(self, target: str, verb: str) -> Outcome | None:
        b = self.b
        if target not in b.doors:
            return Outcome(False, f"You don't know any door called {target[:40]!r}.", "unknown_entity")
        if b.place not in b.doors[target]["rooms"]:
            return Outcome(False, f"You are not next to {target}.", "precondition_unmet")
        return None

    def _face_door(self, target: str) -> SkillRun:
        b = self.b
        pos = b.doors[target]["pos"]
        stands = {c for c in ((pos[0] + dx, pos[1] + dy) for dx, dy in DIR_VEC)
                  if b.room_at(c) == b.place and b.passable(c)}
        return (yield from self._walk(stands, face=pos))

    def _do_open(self, target: str) -> SkillRun:
        b = self.b
        bad = self._door_here(target, "open")
        if bad:
            return bad
        door = b.doors[target]
        if door["state"] == "open":
            return Outcome(False, f"The {target} is already open.", "precondition_unmet")
        if door["state"] == "locked":
            held = b.objects.get(b.holding) if b.holding else None
            if held is None or held.type != "key" or held.color != door["color"]:
                return Outcome(False, f"The {target} is locked; its key is a {door['color']} key.",
                               "precondition_unmet")
        bad = yield from self._face_door(target)
        if bad:
            return bad
        yield TOGGLE
        if b.doors[target]["state"] != "open":  # read again: the belief may have rebuilt its door table
            return Outcome(False, f"The {target} did not open.", "precondition_unmet")
        return Outcome(True, f"You open the {target}.")

    def _do_close(self, target: str) -> SkillRun:
        b = self.b
        bad = self._door_here(target, "close")
        if bad:
            return bad
        if b.doors[target]["state"] != "open":
            return Outcome(False, f"The {target} is not open.", "precondition_unmet")
        bad = yield from self._face_door(target)
        if bad:
            return bad
        if b.pose[:2] == b.doors[target]["pos"]:
            return Outcome(False, f"You stand in the {target}.", "precondition_unmet")
        yield TOGGLE
        return Outcome(b.doors[target]["state"] != "open", f"You close the {target}.")

    def _do_report(self, answer: str) -> SkillRun:
        return Outcome(True, f"You report: {answer}")
        yield  # noqa

    def _do_finish(self, summary: str = "") -> SkillRun:
        return Outcome(True, "You end the task.", finish=True)
        yield  # noqa

    def _do_talk_to(self, person: str, topic: str, message: str = "") -> SkillRun:
        return Outcome(False, f"You don't know anyone called {person[:40]!r}.", "unknown_entity")
        yield  # noqa

    def _do_ask_for_help(self, person: str, request: str, target: str, reason: str,
                         destination: str = "") -> SkillRun:
        return Outcome(False, f"You don't know anyone called {person[:40]!r}.", "unknown_entity")
        yield  # noqa

    def _do_operate(self, device: str, action: str) -> SkillRun:
        return Outcome(False, f"You don't know any device called {device[:40]!r}.", "unknown_entity")
        yield  # noqa

