"""What the agent may see, built only from the belief fields of the world (never the true state)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from sandbox.world import HELD, World

_FACT_TEXT = {
    "locked": "{0} is locked",
    "blocked": "{0} is blocked",
    "restricted": "{0} needs permission to enter",
    "permit": "you may enter {0}",
    "broken": "{0} is broken",
    "heavy": "{0} is too heavy to lift alone",
    "fragile": "{0} is fragile (needs both hands)",
}


def known_map(w: World) -> dict:
    """A compact snapshot of the agent's knowledge: map, last-known positions, learned facts, notes."""
    c = w.c
    places = [(p, c.place[p].name) for p in sorted(w.known_places)]
    conns = []
    for cid in sorted(w.known_conns):
        x = c.conn[cid]
        conns.append((cid, x.a, x.b, w.known_door.get(cid)))
    objects, landmarks = [], {}
    for oid, loc in sorted(w.known_obj.items()):
        if loc is None or oid not in c.obj:
            continue
        if oid in c.fixture_place:  # fixtures are landmarks of their place
            landmarks.setdefault(loc, []).append(oid)
            continue
        objects.append((oid, c.obj[oid].name, "held" if loc == HELD else loc))
    people = [(pid, c.person[pid].name, c.person[pid].role, loc or "unknown")
              for pid, loc in sorted(w.known_person.items())]
    facts = []
    for f in sorted(w.learned):
        kind, _, eid = f.partition(":")
        if kind in _FACT_TEXT:
            facts.append(_FACT_TEXT[kind].format(eid))
        elif kind == "owner":
            oid, _, who = eid.partition("=")
            facts.append(f"{oid} belongs to {c.person[who].name if who in c.person else who}")
    facts += list(w.notes.values())
    return {"place": w.agent_place, "holding": list(w.holding), "places": places, "landmarks": landmarks,
            "connections": conns, "unvisited": [p for _, p in w.unvisited()],
            "objects": objects, "people": people, "facts": facts}


class KnownMap(Mapping):
    """`known_map` of the world after one step, computed when first read: a scripted policy that never reads it
    (the expert plans from the world) does not pay for it, about a third of a step. Read it before the env steps
    again (the episode loop does); a view not read by then has expired, and reading it is an error rather than
    another step's map."""

    __slots__ = ("_world", "_map")

    def __init__(self, world: World):
        self._world: World | None = world
        self._map: dict | None = None

    def _data(self) -> dict:
        if self._map is None:
            if self._world is None:
                raise RuntimeError("this known map belongs to an earlier step of the env and was never read; read "
                                   "info['known'] before the next step")
            self._map = known_map(self._world)
        return self._map

    def expire(self) -> None:
        """The world is about to change: a view not read yet can no longer be."""
        if self._map is None:
            self._world = None

    def __getitem__(self, key: str):
        return self._data()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data())

    def __len__(self) -> int:
        return len(self._data())
