"""The TextWorld teacher: acts on what the agent could know, as the sandbox's expert does.

It reads the objective into steps (`textworld_env.objective.goal_steps`: TextWorld's instruction grammar,
`go north`, `take the X from the Y`, `rest the X on the Y`, ...) and carries them out through the skills from the
agent's map alone (`env.belief`: what it saw), exploring the nearest unvisited exit when a thing it needs has not
been seen. The game's own plan (`policy_commands`) is never read here: that is the oracle's
(`textworld_env.env.OracleAgent`).

    from agent.policies import ScriptedPolicy
    teacher = ScriptedPolicy(Teacher, "textworld-teacher", as_text=True)
"""

from __future__ import annotations

from textworld_env.env import TextWorldEnv, slug
from textworld_env.objective import Step, goal_steps


class Teacher:
    """Carries out the objective's steps from the agent's map; for `agent.policies.ScriptedPolicy`."""

    def __init__(self, env: TextWorldEnv, seed: int = 0):   # a scripted agent's signature; it draws nothing
        self.env = env
        self.steps: list[Step] | None = None
        self.done = 0                      # steps carried out
        self.closing: dict | None = None   # the call that completes the current step, once made
        self.reading = False               # looking for a note that gives the steps
        self.tried: set[str] = set()       # what was tried to open (by it or, as it labels, the student)
        self.failed = 0                    # failures of the current step's own call
        # the room the objective's route has reached: where the game starts (the agent is made after the env's
        # reset), then where each `go` step led. "go east" is east of it, wherever the agent stands: a student it
        # labels may have wandered off, and the label walks back to the route
        self.route: str | None = env.belief.place or None

    def observe(self, call, info, observation) -> None:
        """Told every call made, its own or (labelling a student, taking over from one) another's."""
        b = self.env.belief
        step = self.steps[self.done] if self.steps and self.done < len(self.steps) else None
        if step is not None and step.verb == "go" and self.route is not None \
                and b.place == b.leads.get((self.route, step.thing)):
            self.route = b.place           # whoever walked, the exit the step names was taken
            self.done, self.failed, self.closing = self.done + 1, 0, None
        if self.closing is not None and call == self.closing:
            self.failed = 0 if info.get("error") is None else self.failed + 1
            if info.get("error") is None or self.failed >= 2:   # done, or its own call failed twice: skip it
                self.done, self.failed = self.done + 1, 0
        self.closing = None
        if isinstance(call, dict) and call.get("name") == "open":   # whoever tried it: explored, locked or not
            self.tried.add(str((call.get("arguments") or {}).get("target")))
        note = self._id("note")
        if self.reading and note is not None and isinstance(call, dict) and call.get("name") == "inspect" \
                and (call.get("arguments") or {}).get("target") == note and info.get("error") is None:
            self.steps, self.reading = goal_steps(observation), False   # the note says what to do

    def act(self, info: dict) -> tuple[str, dict]:
        if self.steps is None:
            self.steps = goal_steps(self.env.task_instruction)
            self.reading = not self.steps        # no steps given: a note may say them (tw-simple, goal none)
        if self.reading:
            note = self._id("note")
            if note is None:
                return self._explore("a note that says what to do")[:2]
            go = self._go_to(note)
            return go[:2] if go else ("A note: I read it.", {"name": "inspect", "arguments": {"target": note}})
        if self.route is None:
            self.route = self.env.belief.place
        while self.done < len(self.steps) and not self.env.won:
            out = self._next(self.steps[self.done])
            if out is not None:
                thought, call, closing = out
                self.closing = call if closing else None
                return thought, call
            self.done += 1                 # already so: the next step
        return "Every step of the task is done.", {"name": "finish", "arguments": {"summary": "done"}}

    # ------------------------------------------------------------------ one step

    def _id(self, name: str) -> str | None:
        """The id of a seen thing called `name` (the instruction's words), or None."""
        for thing, (seen, _) in self.env.belief.things.items():
            if seen.lower() == name or slug(seen) == slug(name):
                return thing
        return None

    def _here(self, thing: str) -> bool:
        b = self.env.belief
        where = b.things[thing][1]
        return where in ("held", b.place) or where in b.landmarks.get(b.place, [])

    def _explore(self, why: str):
        """Look where the agent has not: closed containers here, a key here, then the nearest unvisited exit (a
        locked door on the way is opened with a held key), then closed containers elsewhere."""
        b = self.env.belief
        here = b.landmarks.get(b.place, [])
        for box in here:
            if b.doors.get(box) == "closed" and box not in self.tried:
                return f"I have not seen {why} yet; it may be in the {b.things[box][0]}.", \
                    {"name": "open", "arguments": {"target": box}}, False
        for thing, (name, where) in b.things.items():
            if b.kinds.get(thing) == "k" and (where == b.place or where in here):
                return self._open_around(thing) or (f"A {name} may open what is locked.",
                                                    {"name": "pick_up", "arguments": {"object": thing}}, False)
        for target in b.unvisited():
            room, direction = target.rsplit("_", 1)
            door = b.exits.get(room, {}).get(direction)
            if b.doors.get(door or "") == "locked" and not any(b.kinds.get(i) == "k" and w == "held"
                                                                for i, (_, w) in b.things.items()):
                continue
            return f"I have not seen {why} yet; I explore {target}.", \
                {"name": "navigate", "arguments": {"target": target}}, False
        for thing, (name, where) in b.things.items():
            if b.doors.get(thing) == "closed" and thing not in self.tried and b.kinds.get(thing) != "d":
                return f"The {name} is still closed; {why} may be in it.", \
                    {"name": "navigate", "arguments": {"target": where}}, False
        return f"I cannot find {why} anywhere I can reach.", {"name": "finish", "arguments": {"summary": why}}, False

    def _open_around(self, thing: str):
        """The call that opens the closed container a seen thing was in (closed since), or None."""
        b = self.env.belief
        where = b.things[thing][1]
        if where in b.things and b.kinds.get(where) == "c" and b.doors.get(where) in ("closed", "locked"):
            return f"The {b.things[thing][0]} is in the {b.things[where][0]}, which is closed; I open it.", \
                {"name": "open", "arguments": {"target": where}}, False
        return None

    def _go_to(self, thing: str):
        """The call that brings the agent to a seen thing, or None when it is here."""
        b = self.env.belief
        if self._here(thing):
            return None
        where = b.things[thing][1] if b.kinds.get(thing) == "d" else thing
        return f"The {b.things[thing][0]} is elsewhere; I go to it.", \
            {"name": "navigate", "arguments": {"target": where}}, False

    def _next(self, step: Step):
        """(thought, call, whether the call completes the step), or None when the step holds already."""
        b = self.env.belief
        if step.verb == "go":
            if step.thing not in b.exits.get(self.route, {}):   # off the route it knows (a step of its own that
                return None                                     # failed twice was skipped): the next step
            return f"The task says go {step.thing}.", \
                {"name": "navigate", "arguments": {"target": b.exit_id(self.route, step.thing)}}, True
        thing = self._id(step.thing)
        if thing is None:
            source = self._id(step.other) if step.verb == "take" and step.other else None
            if source is not None and not self._here(source):
                return self._go_to(source)
            if source is not None and b.doors.get(source) in ("closed", "locked"):
                return f"The {step.thing} should be in the {step.other}; I open it.", \
                    {"name": "open", "arguments": {"target": source}}, False
            return self._explore(f"the {step.thing}")
        state = b.doors.get(thing)
        if step.verb == "take":
            if b.things[thing][1] == "held":
                return None
            return self._go_to(thing) or self._open_around(thing) or (
                f"I pick up the {step.thing}.", {"name": "pick_up", "arguments": {"object": thing}}, True)
        if step.verb in ("put", "insert", "drop"):
            dest = slug(step.other) if step.verb == "drop" else self._id(step.other)
            if dest is not None and b.things[thing][1] == dest:
                return None                # already there (put there by whoever acted before)
            if b.things[thing][1] != "held":
                return self._go_to(thing) or self._open_around(thing) or (
                    f"I need the {step.thing} first.", {"name": "pick_up", "arguments": {"object": thing}}, False)
            if step.verb == "drop":
                return f"I leave the {step.thing} here.", \
                    {"name": "place", "arguments": {"object": thing, "target": b.place}}, True
            if dest is None:
                return self._explore(f"the {step.other}")
            return self._go_to(dest) or (f"I put the {step.thing} on/in the {step.other}.",
                                         {"name": "place", "arguments": {"object": thing, "target": dest}}, True)
        if step.verb in ("open", "unlock") and state == "open" or step.verb == "close" and state in ("closed",
                                                                                                     "locked"):
            return None
        if step.verb in ("open", "unlock", "close"):
            skill = "close" if step.verb == "close" else "open"
            return self._go_to(thing) or (f"I {step.verb} the {step.thing}.",
                                          {"name": skill, "arguments": {"target": thing}}, True)
        if step.verb in ("lock", "eat"):
            return self._go_to(thing) or (f"I {step.verb} the {step.thing}.",
                                          {"name": "operate", "arguments": {"device": thing, "action": step.verb}},
                                          True)
        return f"I do not know how to {step.verb}.", {"name": "finish", "arguments": {"summary": "stuck"}}, False


