"""Gymnasium env over a TextWorld game, behind the sandbox's env contract (`sandbox.gym_env`): one skill call per
step, the same `info` keys, the known map in the form `agent.prompt.render_known` reads.

    from textworld_env.env import TextWorldEnv
    env = TextWorldEnv()
    obs, info = env.reset(options={"task": {"id": "coin-3", "game": "outputs/textworld/games/coin_collector-....z8"}})
    obs, reward, terminated, truncated, info = env.step({"name": "navigate", "arguments": {"target": "shower_north"}})

What the agent knows is what it saw: the env reads the game's facts only about the agent's own room (the things
there, on its supporters, in its open containers, the held ones, its exits and doors), which is what the room's
description shows; a neighbouring room is known by name only once visited, and until then as an unvisited exit
`ROOM_DIRECTION`. A skill call becomes one game command, or for `navigate` the commands of a walk over known
exits (opening closed doors, unlocking with a held key). A call that names no known thing, or that the game
does not admit, is a typed error and the game does not see it.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
from gymnasium import spaces

from textworld_env.objective import goal_steps, step_things, walkthrough_procedure

DIRECTIONS = ("north", "south", "east", "west")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
# verbs no other skill covers, taken by `operate(device, action)`
OPERATE_VERBS = ("eat", "drink", "cook", "chop", "slice", "dice", "prepare", "lock")
_HEADER = re.compile(r"-= (.+?) =-")


def is_landmark(kind: str) -> bool:
    """Furniture and appliances (supporters, containers, stoves, ovens...), which stay where they are."""
    return kind not in ("o", "k", "f", "d", "P", "I", "r", "meal")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def clean_feedback(text: str) -> str:
    """The game's reply without its prompt and status line (`>   -= Shower =-0/1`) and the banner's blank lines."""
    text = text.split("\n>")[0] if "\n>" in text else text
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class Belief:
    """What the agent has seen: rooms visited, exits and where they lead once taken, doors, things and where."""

    place: str = ""
    rooms: dict[str, str] = field(default_factory=dict)                    # room id -> name
    exits: dict[str, dict[str, str | None]] = field(default_factory=dict)  # room id -> direction -> door id
    leads: dict[tuple[str, str], str] = field(default_factory=dict)        # (room id, direction) -> room id
    doors: dict[str, str] = field(default_factory=dict)                    # door id -> open | closed | locked
    things: dict[str, tuple[str, str]] = field(default_factory=dict)       # id -> (name, where: room/landmark/held)
    landmarks: dict[str, list[str]] = field(default_factory=dict)          # room id -> supporter/container ids
    kinds: dict[str, str] = field(default_factory=dict)                    # id -> TextWorld type (s, c, k, f, o, ...)
    learned: set[str] = field(default_factory=set)
    task_things: list[str] = field(default_factory=list)  # what the objective's steps name (its text says so)

    def exit_id(self, room: str, direction: str) -> str:
        return self.leads.get((room, direction)) or f"{room}_{direction}"

    def route(self, start: str, goal: str) -> list[tuple[str, str]] | None:
        """(room, direction) hops from `start` to the room `goal` over exits taken before, shortest first."""
        prev: dict[str, tuple[str, str] | None] = {start: None}
        todo = deque([start])
        while todo:
            room = todo.popleft()
            if room == goal:
                hops = []
                while prev[room] is not None:
                    hops.append(prev[room])
                    room = prev[room][0]
                return hops[::-1]
            for d in self.exits.get(room, {}):
                nxt = self.leads.get((room, d))
                if nxt and nxt not in prev and self.doors.get(self.exits[room][d] or "", "open") != "locked":
                    prev[nxt] = (room, d)
                    todo.append(nxt)
        return None

    def unvisited(self) -> list[str]:
        """Exits not yet taken, nearest first."""
        out = []
        for room in sorted(self.rooms, key=lambda r: len(self.route(self.place, r) or [None] * 99)):
            out += [f"{room}_{d}" for d in self.exits.get(room, {}) if (room, d) not in self.leads]
        return out

    def known(self) -> dict:
        """The belief in `agent.prompt.render_known`'s form."""
        held = [i for i, (_, where) in self.things.items() if where == "held"]
        places = [(r, n) for r, n in self.rooms.items()] + [(x, x.replace("_", " ")) for x in self.unvisited()]
        connections, listed = [], set()
        for room, exits in self.exits.items():
            for d, door in exits.items():
                if door and door not in listed:      # a door seen from both its rooms is listed once
                    listed.add(door)
                    connections.append((door, room, self.exit_id(room, d), self.doors.get(door, "closed")))
        objects = [(i, n, where) for i, (n, where) in self.things.items()
                   if not is_landmark(self.kinds.get(i, "o")) and self.kinds.get(i) != "d"]
        return {"place": self.place, "holding": held, "places": places, "landmarks": dict(self.landmarks),
                "connections": connections, "unvisited": self.unvisited(), "objects": objects, "people": [],
                "facts": sorted(self.learned), "task_phrases": list(self.task_things)}


class TextWorldEnv(gym.Env):
    """`reset(options={"task": {"id", "game", "step_budget"?}})`; `step(call)`. See the module docstring."""

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, render_mode: str | None = None):
        self.observation_space = spaces.Text(max_length=16_384)
        self.action_space = spaces.Dict({"name": spaces.Text(max_length=64), "arguments": spaces.Dict({})})
        self.render_mode = render_mode
        self._game = None
        self._path: Path | None = None
        self._task: dict = {}
        self.belief = Belief()
        self.steps, self.done, self.won = 0, False, False
        self._last_obs = ""

    # ------------------------------------------------------------------ the contract

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        import textworld
        super().reset(seed=seed)
        task = (options or {}).get("task") or self._task
        if not isinstance(task, dict):       # a `textworld_env.games.GameTask`
            task = {"id": task.id, "game": task.game, "difficulty": task.difficulty, "scene": task.scene}
        if not task:
            raise ValueError("TextWorldEnv.reset needs options={'task': {'id': ..., 'game': PATH}} the first time")
        path = Path(task["game"])
        if not path.is_file():
            raise FileNotFoundError(f"task {task.get('id')!r}: no game file {path}")
        if self._game is None or path != self._path:
            if self._game is not None:
                self._game.close()
            infos = textworld.EnvInfos(facts=True, won=True, lost=True, score=True, max_score=True, objective=True,
                                       admissible_commands=True, policy_commands=True, feedback=True,
                                       extras=["walkthrough"])
            self._game, self._path = textworld.start(str(path), request_infos=infos), path
        self._state = self._game.reset()
        walkthrough = self._state.get("extra.walkthrough") or []
        self._task = {"id": task.get("id", path.stem), "game": str(path), "instruction": self._state.objective,
                      "difficulty": task.get("difficulty", "textworld"), "scene": task.get("scene", path.stem),
                      "optimal_steps": len(walkthrough), "subgoals": [],
                      "procedure": walkthrough_procedure(walkthrough),
                      "step_budget": int(task.get("step_budget") or max(10, 3 * len(walkthrough)))}
        self.belief, self.steps, self.done, self.won = Belief(), 0, False, False
        # the prompt's `Task objects` line: the things the objective's steps name (not every noun of its prose)
        self.belief.task_things = step_things(goal_steps(self._state.objective or ""))
        self._update(self._state)
        self._last_obs = self._describe()
        info = self._info(error=None, learned=sorted(self.belief.learned))
        info["task"] = dict(self._task)
        return self._last_obs, info

    def step(self, action: dict):
        if self._game is None:
            raise RuntimeError("call reset() before step()")
        before, score = set(self.belief.learned), int(self._state.score or 0)
        if self.done:
            obs, error = "The game is over.", "episode_over"
        else:
            self.steps += 1
            if isinstance(action, dict) and "parse_error" in action and "name" not in action:
                obs, error = f"I could not read a skill call: {action['parse_error']}.", "parse_error"
            else:
                obs, error = self._act(action)
        self._last_obs = obs
        terminated = self.done
        truncated = not terminated and self.steps >= self._task["step_budget"]
        reward = 1.0 if (terminated and self.won) else 0.0
        met = [f"point_{k}" for k in range(score + 1, int(self._state.score or 0) + 1)]   # the score's new points
        return obs, reward, terminated, truncated, self._info(error, sorted(self.belief.learned - before), met)

    def render(self):
        return self._last_obs

    @property
    def task_instruction(self) -> str:
        """The game's objective, as the episode's task shows it."""
        return self._task.get("instruction", "")

    def admissible_commands(self) -> list[str]:
        """The commands the game admits now (the random baseline picks among them)."""
        return list(self._state.admissible_commands or [])

    def oracle_commands(self) -> list[str]:
        """The game's own shortest plan from the current state (`policy_commands`): the oracle's, which may read
        the true state; never a teacher's source."""
        return list(self._state.get("policy_commands") or [])

    def close(self):
        if self._game is not None:
            self._game.close()
            self._game = None

    # ------------------------------------------------------------------ skills -> commands

    def _act(self, call: dict) -> tuple[str, str | None]:
        name, args = call.get("name"), call.get("arguments") or {}
        b = self.belief
        if name == "navigate":
            return self._navigate(str(args.get("target", "")))
        if name in ("look_around", "search"):
            return self._send("look")
        if name == "finish":
            self.done = True
            return ("Finished: the task is done." if self.won else "Finished, but the task is not done."), None
        if name in ("talk_to", "ask_for_help", "report"):
            return f"There is no one to answer {name} in this game.", "precondition_unmet"
        target = str(args.get("object") or args.get("target") or args.get("device") or "")
        if target == b.place and target not in b.things and name == "inspect":
            return self._send("look")               # the room itself
        if name == "operate" and target not in b.things:
            # what an operation makes does not exist before it ("prepare meal"): the game's own command names it
            command = f"{args.get('action', '')} {target.replace('_', ' ')}"
            if str(args.get("action", "")) in OPERATE_VERBS and command in self._state.admissible_commands:
                return self._send(command)
        if target not in b.things:                  # a room is no thing to take, open, put or operate
            return f"I know no {target!r} here or anywhere I have been.", "unknown_entity"
        tname = b.things[target][0]
        if name == "inspect":
            return self._send(f"examine {tname}")
        if name == "pick_up":
            where = b.things[target][1]
            return self._send(f"take {tname} from {b.things[where][0]}" if where in b.things else f"take {tname}")
        if name == "place":
            dest = str(args.get("target", ""))
            if dest == b.place:
                return self._send(f"drop {tname}")
            if dest not in b.things:
                return f"I know no {dest!r} to put it on or in.", "unknown_entity"
            verb = "insert {} into {}" if b.kinds.get(dest) == "c" else "put {} on {}"
            return self._send(verb.format(tname, b.things[dest][0]))
        if name in ("open", "close"):
            unlock = [c for c in self._state.admissible_commands if c.startswith(f"unlock {tname} with ")]
            if name == "open" and unlock:           # locked, and the key is held: unlock first
                obs, error = self._send(unlock[0])
                if self.done:                       # unlocking it was the task's last step
                    return obs, error
            obs, error = self._send(f"{name} {tname}")
            if error and name == "open" and tname in self._true("locked"):
                b.doors[target] = "locked"          # trying it told the agent so
                b.learned.add(f"locked:{target}")
                return f"The {tname} is locked.", "precondition_unmet"
            return obs, error
        if name == "operate":
            verb = str(args.get("action", ""))
            if verb not in OPERATE_VERBS:
                return f"operate here takes one of {', '.join(OPERATE_VERBS)}, not {verb!r}.", "bad_argument_value"
            options = [c for c in self._state.admissible_commands if c.startswith(f"{verb} {tname}")]
            if not options:
                return f"You cannot {verb} the {tname} here.", "precondition_unmet"
            return self._send(options[0])
        return f"There is no skill {name!r}.", "unknown_tool"

    def _navigate(self, target: str) -> tuple[str, str | None]:
        b = self.belief
        room, then = target, None
        if target in b.things:                      # an object: walk to where it was seen
            where = b.things[target][1]
            room = next((r for r, lms in b.landmarks.items() if where in lms), where)
        m = re.fullmatch(r"(.+)_(north|south|east|west)", target)
        if target not in b.rooms and m and m.group(1) in b.rooms:
            room, then = m.group(1), m.group(2)     # an unvisited exit: walk to its room, then take it
        if room == "held" or room not in b.rooms:
            return f"I know no place {target!r}.", "unknown_entity"
        if then and then not in b.exits.get(room, {}):
            return f"The {b.rooms[room]} has no exit {then}.", "unknown_entity"
        hops = b.route(b.place, room)
        if hops is None:
            return f"I know no open way to {room}.", "unreachable"
        hops = hops + ([(room, then)] if then else [])
        if not hops:
            return f"You are in the {b.rooms[room]} already.", None
        obs = ""
        for here, d in hops:
            door = b.exits[here][d]
            if door and b.doors.get(door) != "open":
                obs, error = self._act({"name": "open", "arguments": {"target": door}})
                if error:
                    return obs, error
            obs, error = self._send(f"go {d}")
            if error:
                return obs, error
        return obs, None

    def _true(self, predicate: str) -> set[str]:
        """The names of the things `predicate` holds of now (read only for what the agent just tried)."""
        return {p.arguments[0].name for p in self._state.facts if p.name == predicate}

    def _send(self, command: str) -> tuple[str, str | None]:
        """One game command. One the game does not admit now is an error (the game still answers it, as it
        would a player)."""
        if self.done:        # the game ended with the command before (unlocking won, say): nothing more is sent
            return "The game is over.", "episode_over"
        admissible = command in self._state.admissible_commands
        self._state, _, done = self._game.step(command)
        self._update(self._state)
        self.won = bool(self._state.won)
        self.done = self.done or bool(done)
        return clean_feedback(self._state.feedback), (None if admissible else "precondition_unmet")

    # ------------------------------------------------------------------ belief from the agent's own room

    def _update(self, state) -> None:
        b = self.belief
        # sorted: TextWorld's facts, like the sets below, come in an order that changes with PYTHONHASHSEED, and the
        # order things are read in is the order the prompt lists them (the same game must give the same prompts)
        facts = sorted((p.name, [(a.name, a.type) for a in p.arguments]) for p in state.facts)
        here = next((a[1][0] for n, a in facts if n == "at" and a[0][1] == "P"), None)
        if here is None:
            return
        room = slug(here)
        previous = b.place
        b.place = room
        b.rooms.setdefault(room, here)
        visible = {a[0][0] for n, a in facts if n == "at" and a[1][0] == here and a[0][1] != "P"}
        types = {x: t for _, a in facts for x, t in a}
        opened = {a[0][0] for n, a in facts if n == "open"}
        closed = {a[0][0] for n, a in facts if n in ("closed", "locked")}
        for thing in list(b.things):
            if b.things[thing][1] == "held":
                b.things.pop(thing)               # re-read from the inventory facts below
        b.landmarks[room] = sorted(slug(x) for x in visible if is_landmark(types[x]))
        for x in sorted(visible):
            b.things[slug(x)], b.kinds[slug(x)] = (x, room), types[x]
            if x in opened:                       # a container's state shows; its lock only once tried
                b.doors[slug(x)] = "open"
            elif x in closed and b.doors.get(slug(x)) != "locked":
                b.doors[slug(x)] = "closed"
        for n, a in facts:
            if n in ("on", "in") and a[1][0] in visible and (n == "on" or a[1][0] in opened or a[1][0] not in closed):
                b.things[slug(a[0][0])], b.kinds[slug(a[0][0])] = (a[0][0], slug(a[1][0])), a[0][1]
            elif n == "in" and a[1][1] == "I":
                b.things[slug(a[0][0])], b.kinds[slug(a[0][0])] = (a[0][0], "held"), a[0][1]
        exits = b.exits.setdefault(room, {})
        for n, a in facts:
            d = n[:-3] if n.endswith("_of") and n[:-3] in DIRECTIONS else None
            if d and a[1][0] == here:
                exits.setdefault(d, None)
        for n, a in facts:
            if n == "link" and a[0][0] == here:
                d = next((x[:-3] for x, y in facts if x[:-3] in DIRECTIONS and x.endswith("_of")
                          and y[0][0] == a[2][0] and y[1][0] == here), None)
                if d:
                    exits[d] = slug(a[1][0])
                    door = slug(a[1][0])
                    b.things[door], b.kinds[door] = (a[1][0], room), "d"
                    if b.doors.get(door) != "locked" or a[1][0] in opened:
                        b.doors[door] = "open" if a[1][0] in opened else "closed"
        if previous and previous != room:       # the walk just taken: remember where that exit leads
            for d, _ in b.exits.get(previous, {}).items():
                if any(x == f"{d}_of" and y[0][0] == here and slug(y[1][0]) == previous for x, y in facts):
                    b.leads[(previous, d)], b.leads[(room, OPPOSITE[d])] = room, previous

    def _describe(self) -> str:
        """At reset: the first room's description (the game's banner and objective cut: the task says it)."""
        text = self._state.feedback
        start = _HEADER.search(text)
        return clean_feedback(text[start.start():] if start else text)

    def _info(self, error: str | None, learned: list[str], met: list[str] | None = None) -> dict:
        s = self._state
        facts = sorted(str(p) for p in s.facts)
        key = hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]
        held = [i for i, (_, where) in self.belief.things.items() if where == "held"]
        return {"state_key": key, "steps": self.steps, "step_budget": self._task["step_budget"], "error": error,
                "trigger": None, "success": self.won, "subgoals_met": met or [], "subgoals_done": int(s.score or 0),
                "subgoals_total": int(s.max_score or 0), "place": self.belief.place, "holding": held,
                "learned": learned, "known": self.belief.known(), "human_reply": None, "answer": None}


def call_for_command(command: str, belief: Belief) -> dict | None:
    """The skill call that does a game command (a walkthrough's step, say) from the agent's belief; None for a
    command no skill stands for (`inventory`)."""
    words = command.split(" ")
    verb, rest = words[0], " ".join(words[1:])
    ids = {name: i for i, (name, _) in belief.things.items()}
    if verb == "go":
        return {"name": "navigate", "arguments": {"target": belief.exit_id(belief.place, rest)}}
    if verb == "look":
        return {"name": "look_around", "arguments": {}}
    if verb == "take":
        return {"name": "pick_up", "arguments": {"object": ids.get(rest.split(" from ")[0], slug(rest))}}
    if verb in ("put", "insert"):
        obj, dest = re.split(r" on | into ", rest, maxsplit=1)
        return {"name": "place", "arguments": {"object": ids.get(obj, slug(obj)), "target": ids.get(dest, slug(dest))}}
    if verb == "drop":
        return {"name": "place", "arguments": {"object": ids.get(rest, slug(rest)), "target": belief.place}}
    if verb in ("open", "close", "examine"):
        return {"name": {"examine": "inspect"}.get(verb, verb), "arguments": {"target": ids.get(rest, slug(rest))}}
    if verb == "unlock":
        target = rest.split(" with ")[0]
        return {"name": "open", "arguments": {"target": ids.get(target, slug(target))}}
    if verb in OPERATE_VERBS:
        target = rest.split(" with ")[0]
        return {"name": "operate", "arguments": {"device": ids.get(target, slug(target)), "action": verb}}
    return None


class OracleAgent:
    """Plays the game's own plan from wherever the episode is (`TextWorldEnv.oracle_commands`), through the
    skills: the oracle baseline, and the proof that a game is solvable in its budget. For
    `agent.policies.ScriptedPolicy(OracleAgent, "oracle")` (the seed is not used: the plan is the game's)."""

    def __init__(self, env: TextWorldEnv, seed: int = 0):
        self.env = env

    def act(self, info: dict) -> tuple[str, dict]:
        for command in self.env.oracle_commands():
            call = call_for_command(command, self.env.belief)
            if call is not None and not (call["name"] == "open"
                                         and self.env.belief.doors.get(call["arguments"]["target"]) == "open"):
                return f"The plan says: {command}.", call
        return "Nothing is left to do.", {"name": "finish", "arguments": {"summary": "done"}}

    def observe(self, call, info, observation) -> None:
        pass


class RandomAgent:
    """A random choice among the admissible commands that a skill stands for: the floor any policy must beat.
    For `agent.policies.ScriptedPolicy(RandomAgent, "random")`."""

    def __init__(self, env: TextWorldEnv, seed: int):
        self.env, self.rng = env, random.Random(seed)

    def act(self, info: dict) -> tuple[str, dict]:
        calls = [c for c in (call_for_command(x, self.env.belief) for x in self.env.admissible_commands()) if c]
        return "A random admissible command.", self.rng.choice(calls) if calls else {"name": "finish",
                                                                                       "arguments": {}}

    def observe(self, call, info, observation) -> None:
        pass
