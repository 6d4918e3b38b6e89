"""Pixel perception for grid worlds: an RGB frame becomes a cell grid (type, colour, state), the agent's pose and
the mask of cells the agent sees now. The policy side runs it; it never touches an environment object.

`SpriteDetector` (the offline default) is calibrated from MiniGrid's own sprite rendering: every tile MiniGrid can
draw (each object type, colour and door state; the agent's triangle in four directions on the cells it can stand
on or, in a first-person frame, over what it carries; each with and without the light highlight of the field of
view) is rendered once, and a frame is read tile by tile, by exact lookup first and nearest template second. A
tile that is far from every template becomes an `unknown` cell, never an exception. Grey walls (a full grey
square) and grey objects (a sprite on black) are different templates, so they never mix.

`VisionPerception` (online) asks any OpenAI-compatible vision model for the same `Percept`, as validated JSON.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field

import numpy as np

# MiniGrid's encoding indices (minigrid.core.constants), restated so the policy side does not need the env package
# for anything but the sprite calibration
TYPES = ("unseen", "empty", "wall", "floor", "door", "key", "ball", "box", "goal", "lava", "agent")
TYPE_IDX = {t: i for i, t in enumerate(TYPES)}
UNKNOWN = 255  # a tile no template explains
COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
COLOR_IDX = {c: i for i, c in enumerate(COLORS)}
STATES = ("open", "closed", "locked")
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))  # MiniGrid's agent directions: east, south, west, north
CARRYABLE = ("key", "ball", "box")
VIEWS = ("topdown", "topdown-fov", "egocentric")


@dataclass
class Percept:
    """What one frame shows. `cells[x, y] = (type, colour, state)` in MiniGrid's encoding (type `UNKNOWN` when no
    template explains the tile, `unseen` for cells the frame does not show); `visible[x, y]` marks the field of
    view (the highlighted cells); `agent` is (x, y, direction) or None when no agent sprite is found. In an
    egocentric frame the agent stands at the bottom centre facing up, and the cell under it shows what it
    carries (`carried`)."""

    cells: np.ndarray
    visible: np.ndarray
    agent: tuple[int, int, int] | None
    view: str
    carried: tuple[int, int] | None = None  # (type, colour) drawn under the agent in an egocentric frame
    unknown: int = 0

    def to_payload(self) -> dict:
        """Plain data for the evaluator (perception accuracy) and for logs."""
        return {"cells": self.cells.tolist(), "visible": self.visible.tolist(), "agent": self.agent,
                "view": self.view, "carried": self.carried, "unknown": self.unknown}


def _minigrid_objects():
    """Every object MiniGrid can draw in a BabyAI level, with the cell encodings they carry."""
    from minigrid.core.world_object import Ball, Box, Door, Floor, Goal, Key, Lava, Wall

    objs = [None, Wall(), Goal(), Lava()]
    for c in COLORS:
        objs += [Key(c), Ball(c), Box(c), Floor(c), Door(c, is_open=True), Door(c, is_open=False),
                 Door(c, is_open=False, is_locked=True)]
    return objs


@dataclass
class SpriteDetector:
    """Reads MiniGrid frames rendered at `tile_size` pixels per cell (see the module docstring)."""

    tile_size: int = 8
    max_mean_abs_error: float = 12.0  # mean per-channel difference above which a tile is `unknown`
    _labels: list = field(default_factory=list, repr=False)
    _stack: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self):
        from minigrid.core.grid import Grid

        if self.tile_size < 4:
            raise ValueError(f"SpriteDetector: tile_size must be >= 4 pixels, not {self.tile_size}")
        tiles = []
        for obj in _minigrid_objects():
            enc = obj.encode() if obj is not None else (TYPE_IDX["empty"], 0, 0)
            agent_dirs = [None]
            if obj is None or obj.type in ("goal", "floor", "lava") or (obj.type == "door" and obj.is_open):
                agent_dirs += [0, 1, 2, 3]  # cells the agent can stand on
            if obj is not None and obj.type in CARRYABLE:
                agent_dirs += [3]  # egocentric frames draw the carried object under the agent (facing up)
            for d in agent_dirs:
                for hl in (False, True):
                    img = Grid.render_tile(obj, agent_dir=d, highlight=hl, tile_size=self.tile_size)
                    label = (tuple(int(v) for v in enc), d, hl)
                    tiles.append(img.astype(np.int16).reshape(-1))
                    self._labels.append(label)
        self._stack = np.stack(tiles)
        self._proj = np.random.default_rng(0).integers(1, 2**20, size=self._stack.shape[1], dtype=np.int64)
        self._by_code = {}
        for i, code in enumerate((self._stack.astype(np.int64) @ self._proj).tolist()):
            self._by_code.setdefault(code, i)

    def classify(self, tile: np.ndarray) -> tuple[tuple[int, int, int] | None, int | None, bool]:
        """(encoding or None for unknown, agent direction or None, highlighted) of one tile: the nearest template
        (mean absolute pixel difference), or unknown when even that one is too far."""
        err = np.abs(self._stack - tile.astype(np.int16).reshape(1, -1)).mean(axis=1)
        best = int(err.argmin())
        if err[best] > self.max_mean_abs_error:
            # still say whether it looks highlighted: the mean brightness of a highlighted tile is >= 0.3 * 255
            return None, None, bool(tile.mean() >= 70)
        return self._labels[best]

    def perceive(self, frame: np.ndarray, view: str = "topdown") -> Percept:
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r}; choose one of {', '.join(VIEWS)}")
        frame = np.asarray(frame)
        ts = self.tile_size
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"a frame must be an HxWx3 uint8 RGB array, not {frame.dtype} {frame.shape}")
        h, w = frame.shape[0] // ts, frame.shape[1] // ts
        if h == 0 or w == 0:
            raise ValueError(f"a frame of {frame.shape[1]}x{frame.shape[0]} pixels holds no {ts}-pixel tile")
        # tiles in row-major cell order (y, x), each flattened; a fixed random projection hashes each tile to one
        # integer, and the hit is confirmed against the template's pixels (so a hash collision cannot mislabel)
        tiles = frame[:h * ts, :w * ts].reshape(h, ts, w, ts, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, -1)
        codes = (tiles.astype(np.int64) @ self._proj).tolist()
        cells = np.zeros((w, h, 3), dtype=np.int64)
        visible = np.zeros((w, h), dtype=bool)
        agent, carried, unknown = None, None, 0
        carryable = {TYPE_IDX[t] for t in CARRYABLE}
        for n, code in enumerate(codes):
            y, x = divmod(n, w)
            i = self._by_code.get(code)
            if i is not None and np.array_equal(self._stack[i], tiles[n]):
                enc, d, hl = self._labels[i]
            else:
                enc, d, hl = self.classify(tiles[n])
            visible[x, y] = hl
            if enc is None:
                cells[x, y] = (UNKNOWN, 0, 0)
                unknown += 1
                continue
            if d is not None:
                if enc[0] in carryable:  # the carried object drawn under the agent (egocentric frames)
                    carried = (enc[0], enc[1])
                    enc = (TYPE_IDX["empty"], 0, 0)
                agent = (x, y, d)
            cells[x, y] = enc
        if view == "egocentric":
            # a first-person frame draws cells the agent cannot see too (behind walls): those are `unseen`, whatever
            # they show (in `topdown-fov` the belief decides what counts: the map from every cell, objects only
            # from the highlighted ones)
            cells[~visible] = (TYPE_IDX["unseen"], 0, 0)
        return Percept(cells=cells, visible=visible, agent=agent, view=view, carried=carried, unknown=unknown)


# ----------------------------------------------------------------------------- online: a vision model


VISION_PROMPT = (
    "This is a top-down frame of a grid world, {w} cells wide and {h} high ({ts} pixels per cell; x grows to the "
    "right, y downwards, (0, 0) is the top-left cell). Grey squares are walls; the red triangle is you, pointing "
    "where you face (0 east, 1 south, 2 west, 3 north). List every non-empty, non-wall cell and where you are as "
    'JSON: {{"agent": {{"x": int, "y": int, "dir": int}}, "cells": [{{"x": int, "y": int, "type": "key|ball|box|door|'
    'goal|lava", "color": "red|green|blue|purple|yellow|grey", "state": "open|closed|locked|null"}}]}}. Walls: '
    'list them as "wall_cells": [[x, y], ...].'
)


def _png_data_url(frame: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class VisionPerception:
    """Perception by any OpenAI-compatible vision model (`agent.clients.OpenAIClient`). The reply is validated
    (types, colours, states, coordinates inside the grid); an item that fails validation becomes an `unknown`
    cell, an unreadable reply an all-`unknown` frame: a bad reply never crashes an episode. Top-down frames only
    (the reply's coordinates are the frame's)."""

    def __init__(self, client, tile_size: int = 8):
        self.client, self.tile_size = client, tile_size

    def perceive(self, frame: np.ndarray, view: str = "topdown") -> Percept:
        if view == "egocentric":
            raise ValueError("VisionPerception reads top-down frames; use view topdown or topdown-fov")
        h, w = frame.shape[0] // self.tile_size, frame.shape[1] // self.tile_size
        messages = [{"role": "user", "content": [
            {"type": "text", "text": VISION_PROMPT.format(w=w, h=h, ts=self.tile_size)},
            {"type": "image_url", "image_url": {"url": _png_data_url(frame)}}]}]
        reply = self.client.chat(messages, json_mode=True)
        return parse_vision_reply(reply.text, w, h, view)


def parse_vision_reply(text: str, w: int, h: int, view: str = "topdown") -> Percept:
    """A vision model's JSON as a Percept (see `VisionPerception`)."""
    cells = np.zeros((w, h, 3), dtype=np.int64)
    cells[:, :, 0] = TYPE_IDX["empty"]
    visible = np.ones((w, h), dtype=bool)
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError:
        cells[:, :] = (UNKNOWN, 0, 0)
        return Percept(cells=cells, visible=visible, agent=None, view=view, unknown=w * h)
    unknown = 0

    def inside(x, y) -> bool:
        return isinstance(x, int) and isinstance(y, int) and 0 <= x < w and 0 <= y < h

    for xy in data.get("wall_cells") or []:
        if isinstance(xy, list) and len(xy) == 2 and inside(*xy):
            cells[xy[0], xy[1]] = (TYPE_IDX["wall"], COLOR_IDX["grey"], 0)
    for it in data.get("cells") or []:
        if not isinstance(it, dict) or not inside(it.get("x"), it.get("y")):
            continue
        t, c, s = it.get("type"), it.get("color"), it.get("state")
        if t in ("key", "ball", "box", "door", "goal", "lava", "wall") and (c in COLOR_IDX or t in ("goal", "lava",
                                                                                                   "wall")):
            state = STATES.index(s) if (t == "door" and s in STATES) else 0
            cells[it["x"], it["y"]] = (TYPE_IDX[t], COLOR_IDX.get(c, 0), state)
        else:
            cells[it["x"], it["y"]] = (UNKNOWN, 0, 0)
            unknown += 1
    a = data.get("agent")
    agent = None
    if isinstance(a, dict) and inside(a.get("x"), a.get("y")) and a.get("dir") in (0, 1, 2, 3):
        agent = (a["x"], a["y"], a["dir"])
    return Percept(cells=cells, visible=visible, agent=agent, view=view, unknown=unknown)
