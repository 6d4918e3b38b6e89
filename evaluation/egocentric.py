"""First-person frames: the belief a policy builds from the agent's own 7x7 view alone.

A first-person frame never shows where the agent is, so the belief keeps its own map: a canvas in the agent's
starting frame (it starts in the middle, facing "north"), the pose carried forward by dead reckoning from the
agent's own actions (turns always turn; a step forward moves only onto a cell the last frame showed free, which is
exactly when MiniGrid moves the agent, as the cell ahead is always in view). Each frame's visible cells are
written into the canvas through that pose; cells never seen stay `unseen`.

Rooms are the regions of seen floor between walls and doors, found again as more is seen; a room keeps its id as
it grows (the oldest id among the regions that merge) and ids count up in order of discovery (`room_1`, ...);
doors are numbered the same way (`red_door_1`). A door whose far side has not been seen joins its room to
`unexplored`. What the agent can do with that map is the same as with a top-down one (`GridBelief`), through the
same skill executor and prompt format.
"""

from __future__ import annotations

import numpy as np

from evaluation.gridworld import FORWARD, LEFT, RIGHT, GridBelief, regions_of
from evaluation.perception import COLORS, DIR_VEC, STATES, TYPE_IDX, Percept

_WALL, _DOOR, _UNSEEN = TYPE_IDX["wall"], TYPE_IDX["door"], TYPE_IDX["unseen"]
UNEXPLORED = "unexplored"


class EgoBelief(GridBelief):
    """`GridBelief` over a canvas filled from first-person frames (module docstring)."""

    def __init__(self, radius: int = 40):
        super().__init__("topdown")
        self.view = "egocentric"
        n = 2 * radius + 1
        self.cells = np.zeros((n, n, 3), dtype=np.int64)  # all unseen
        self.room_of = -np.ones((n, n), dtype=np.int64)
        self._room_ids: list[str] = []
        self.pose = (radius, radius, 3)
        self.start = self.pose
        self._anchors: list[tuple[tuple[int, int], str]] = []  # (first cell seen, room id), oldest first
        self._door_ids: dict[tuple[int, int], str] = {}

    def to_canvas(self, vx: int, vy: int, pose=None) -> tuple[int, int]:
        """The canvas cell of view cell (vx, vy) (the agent at (3, 6) facing up)."""
        x, y, d = pose or self.pose
        fx, fy = DIR_VEC[d]
        rx, ry = DIR_VEC[(d + 1) % 4]
        f, r = 6 - vy, vx - 3
        return x + f * fx + r * rx, y + f * fy + r * ry

    def update(self, p: Percept, last_action: int | None = None) -> None:
        if p.view != "egocentric":
            raise ValueError("EgoBelief reads first-person frames (view egocentric)")
        x, y, d = self.pose
        front = self.front()
        if last_action == LEFT:
            d = (d - 1) % 4
        elif last_action == RIGHT:
            d = (d + 1) % 4
        elif last_action == FORWARD and self.passable(front) and int(self.cells[front][0]) != _UNSEEN:
            t, _, s = (int(v) for v in self.cells[front])
            if t != _DOOR or STATES[s] == "open":  # a closed door does not let the agent through
                x, y = front
        self.pose = (x, y, d)
        seen: list[tuple[tuple[int, int], np.ndarray]] = []
        for vx in range(7):
            for vy in range(7):
                if p.visible[vx, vy]:
                    seen.append((self.to_canvas(vx, vy), p.cells[vx, vy]))
        new_structure = False
        for c, enc in seen:
            old = self.cells[c]
            if int(old[0]) == _UNSEEN and int(enc[0]) != _UNSEEN or \
                    (int(enc[0]) in (_WALL, _DOOR)) != (int(old[0]) in (_WALL, _DOOR)):
                new_structure = True
        self.track_objects(seen, last_action, front)
        for c, enc in seen:
            self.cells[c] = enc
        if new_structure:
            self._segment()
        for door in self.doors.values():
            door["state"] = STATES[int(self.cells[door["pos"]][2])]
        r = self.room_at(self.pose[:2])
        if r is not None:
            self.place = r
            self.visited.add(r)

    def _segment(self) -> None:
        cells = self.cells
        floor = (cells[:, :, 0] != _UNSEEN) & ~np.isin(cells[:, :, 0], (_WALL, _DOOR))
        label, regions = regions_of(floor)
        # stable ids: a region keeps the oldest id anchored in it; a region with none gets the next id
        ids: list[str] = []
        for i, region in enumerate(regions):
            mine = [(n, rid) for n, (cell, rid) in enumerate(self._anchors) if label[cell] == i]
            if mine:
                ids.append(min(mine)[1])
            else:
                rid = f"room_{len(self._anchors) + 1}"
                ids.append(rid)
                self._anchors.append((min(region), rid))
        self.room_of = label
        self._room_ids = ids
        self.rooms = sorted({(rid, rid.replace("_", " ")) for rid in ids}, key=lambda r: int(r[0].split("_")[1]))
        self.room_cells = {}
        for i, region in enumerate(regions):
            self.room_cells.setdefault(ids[i], []).extend(region)
        self.doors, self.door_at = {}, {}
        for dx_, dy_ in zip(*np.nonzero(cells[:, :, 0] == _DOOR), strict=True):
            pos = (int(dx_), int(dy_))
            color = COLORS[int(cells[pos][1])]
            if pos not in self._door_ids:
                n = sum(1 for v in self._door_ids.values() if v.startswith(color + "_")) + 1
                self._door_ids[pos] = f"{color}_door_{n}"
            did = self._door_ids[pos]
            sides = sorted({ids[label[pos[0] + a, pos[1] + b]] for a, b in DIR_VEC
                            if label[pos[0] + a, pos[1] + b] >= 0})
            self.doors[did] = {"pos": pos, "color": color, "rooms": sides + [UNEXPLORED] * (2 - len(sides)),
                               "state": STATES[int(cells[pos][2])]}
            self.door_at[pos] = did

    def describe(self) -> str:
        names = dict(self.rooms)
        parts = [f"You are in {names.get(self.place, 'a room')} [{self.place}]."]
        here = [o for o in self.known_objects() if o.pos is not None and self.room_at(o.pos) == self.place and
                o.oid in self.seen_now]
        if here:
            parts.append("You see: " + ", ".join(f"{o.name} [{o.oid}]" for o in sorted(here, key=lambda o: o.oid))
                         + ".")
        exits = [f"{names.get(other, 'unexplored')} [{other}] via {did} ({d['state']})"
                 for did, d in sorted(self.doors.items()) if self.place in d["rooms"]
                 for other in d["rooms"] if other != self.place]
        if exits:
            parts.append("Exits: " + "; ".join(exits) + ".")
        if self.holding:
            parts.append(f"Holding: {self.objects[self.holding].name} [{self.holding}].")
        return " ".join(parts)

