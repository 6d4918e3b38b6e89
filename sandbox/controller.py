"""EnvController: validates every skill call against the state and the triggers, then applies it.

It never raises on model input: whatever `call` is, `step` returns a StepResult with either no error or
a specific code. A call rejected by validation leaves the state untouched; an obstacle (a trigger) may
leave the agent where it got to and teach it what stopped it, as a real world would.
"""

from __future__ import annotations

from typing import Any

from sandbox.human import HumanAgent
from sandbox.schema import TaskInstance
from sandbox.skills import SKILLS, CallError, StepResult, check_call
from sandbox.text import normalize, report_matches
from sandbox.world import HELD, Compiled, World

# skills whose handlers never change objects, people, restrictions, hidden places or blocked paths: the
# state key reuses that part. Everything else (pick_up, place, open, close, operate, talk_to, ask_for_help)
# refreshes it; tests compare every cached key with a fresh one.
_OBJECTS_UNTOUCHED = frozenset({"navigate", "look_around", "search", "inspect", "report", "finish"})


class EnvController:
    """One episode of one task. `validate`-then-apply happens inside `step(call)`."""

    def __init__(self, task: TaskInstance | Compiled, human: HumanAgent | None = None):
        self.compiled = task if isinstance(task, Compiled) else Compiled(task)
        self.task = self.compiled.task
        self.human = human or HumanAgent(self.compiled)
        self.world: World = self.compiled.initial  # replaced by a clone at reset(); never stepped before it
        self.steps = 0
        self.fired: dict[str, int] = {}
        self.crossed: list[str] = []   # connections walked through (the builder reads it)
        self.reset_subgoals: list[str] = []  # subgoals already met by the initial state
        self._handlers = {name: getattr(self, "_do_" + name) for name in SKILLS}
        self._n_subgoals = len(self.task.subgoals)
        self.done = False
        self.success = False

    # ------------------------------------------------------------------ public API

    def reset(self, world: World | None = None) -> str:
        """Start an episode from the task's initial state (or a given world); returns the first observation."""
        self.steps, self.fired, self.done, self.success = 0, {}, False, False
        self.crossed = []
        c = self.compiled
        if world is not None:
            self.world = world.clone()
            text = self.describe_place(first=True)
            self.world.touch()
            self.reset_subgoals = self._latch()
            return text
        if c.reset_cache is None:  # the first observation is the same every episode: compute it once
            self.world = c.initial.clone()
            text = self.describe_place(first=True)
            self.world.touch()
            met = self._latch()  # subgoals already true before any action are met at reset, not by it
            self.world.state_key()
            c.reset_cache = (self.world, text, met)
        start, text, self.reset_subgoals = c.reset_cache
        self.world = start.clone()
        return text

    def state_key(self) -> str:
        return self.world.state_key()

    def subgoal_progress(self) -> tuple[int, int]:
        return self.world.latched, len(self.task.subgoals)

    def validate(self, call: Any) -> tuple[str, dict[str, str]] | StepResult:
        """Check the call's shape against the skill specs: (name, arguments) or an error result."""
        if self.done:
            return self._err("episode_over", "The episode is over.")
        checked = check_call(call)
        if isinstance(checked, CallError):
            return self._err(checked.code, checked.text)
        return checked

    def step(self, call: Any) -> StepResult:
        if self.world is self.compiled.initial:  # stepping without reset(): never mutate the shared initial world
            self.world = self.compiled.initial.clone()
        checked = self.validate(call)
        if isinstance(checked, StepResult):
            if checked.error != "episode_over":
                self.steps += 1
            return checked
        self.steps += 1
        name, args = checked
        res = self._handlers[name](**args)
        if name in _OBJECTS_UNTOUCHED:
            self.world.touch()
        else:
            self.world.touch_objects()
        res.subgoals_met = self._latch() if self.world.latched < self._n_subgoals else []
        if name == "finish":
            self.done = res.done = True
            self.world.finished = True
            self.success = res.success = self.is_success()
        if res.trigger is not None:
            self.fired[res.trigger] = self.fired.get(res.trigger, 0) + 1
        res.state_key = self.world.state_key()
        return res

    def is_success(self) -> bool:
        return self.world.latched == len(self.task.subgoals) and all(self.holds(p) for p in self.task.success)

    # ------------------------------------------------------------------ helpers

    def _err(self, code: str, text: str, trigger: str | None = None) -> StepResult:
        return StepResult(ok=False, observation=text, error=code, trigger=trigger, state_key=self.world.state_key())

    def _ok(self, text: str) -> StepResult:
        return StepResult(ok=True, observation=text)

    def _label(self, eid: str) -> str:
        return f"{self.compiled.display_name(eid)} [{eid}]"

    def _knows_obj(self, oid: str) -> bool:
        return oid in self.compiled.obj and oid in self.world.known_obj

    def observe_here(self) -> list[str]:
        """Update the belief with what is in plain sight here; return the visible portable object ids."""
        w, c = self.world, self.compiled
        here = w.agent_place
        seen = []
        learned = w.learned
        w.visited.add(here)
        for oid in c.openable_fixtures_at[here]:  # fixtures are landmarks on the map; only their state is news
            is_open, is_closed = c.open_facts[oid]
            if w.obj[oid]["open"]:
                learned.discard(is_closed)
                learned.add(is_open)
            else:
                learned.discard(is_open)
                learned.add(is_closed)
        obj_state, known = w.obj, w.known_obj
        fixture_place, closable = c.fixture_place, c.closable
        for oid in c.portable:
            loc = obj_state[oid]["loc"]
            if loc == here:  # fast paths: on the floor here, or on/in a fixture (fixtures never move)
                vis = True
            elif loc in fixture_place:
                vis = fixture_place[loc] == here and (loc not in closable or obj_state[loc]["open"])
            elif loc == HELD or loc in c.place:
                vis = False
            else:
                vis = w.visible(oid)
            if vis:
                seen.append(oid)
                known[oid] = loc
                learned.add("seen:" + oid)
                if c.obj[oid].openable:  # you can see whether a box stands open
                    st = obj_state[oid]["open"]
                    learned.discard(f"state:{oid}:open={not st}")
                    learned.add(f"state:{oid}:open={st}")
            else:
                kl = known.get(oid)
                if kl is None or kl == HELD:
                    continue
                # believed here in plain sight but it is not: the belief becomes "unknown"
                if kl == here or (kl in c.obj and w.place_of(kl) == here and w.visible(kl)
                                  and (not c.obj[kl].openable or c.obj[kl].surface or obj_state[kl]["open"])):
                    known[oid] = None
        for cid, nxt in c.adj[here]:
            if cid in w.hidden:
                continue
            w.known_conns.add(cid)
            w.known_places.add(nxt)
            st = w.door[cid]
            if st == "locked" and not c.locks_visible and ("locked:" + cid) not in w.learned:
                st = "closed"  # a locked door looks closed until someone tries it
            w.known_door[cid] = st
        for pid, pl in w.person_place.items():
            if pl == here:
                w.known_person[pid] = here
            elif w.known_person.get(pid) == here:
                w.known_person[pid] = None  # they were here and have gone
        return seen

    def describe_place(self, first: bool = False) -> str:
        """The observation of the current place: what is in plain sight, who is here, the exits, holdings."""
        w, c = self.world, self.compiled
        here = w.agent_place
        seen = c.fixtures_at[here] + self.observe_here()
        label, obj_state = c.label, w.obj
        parts = [c.here_text[here]]
        if seen:
            items = []
            for oid in seen:
                loc = obj_state[oid]["loc"]
                items.append(label[oid] if loc == here else label[oid] + c.inside_text[loc])
            parts.append("You see: " + ", ".join(items) + ".")
        people = [label[p] for p, pl in w.person_place.items() if pl == here]
        if people:
            parts.append("People here: " + ", ".join(people) + ".")
        hidden, kd = w.hidden, w.known_door
        exits = []
        for cid, text in c.exit_text[here]:
            if cid in hidden:
                continue
            st = kd.get(cid)
            exits.append(f"{text} ({st})" if st else text)
        parts.append("Exits: " + "; ".join(exits) + ".")
        if w.holding:
            parts.append("Holding: " + ", ".join(label[h] for h in w.holding) + ".")
        return " ".join(parts)

    # ------------------------------------------------------------------ skills

    def _do_navigate(self, target: str) -> StepResult:
        w, c = self.world, self.compiled
        if target in c.place and target in w.known_places:
            dest, obj = target, None
        elif self._knows_obj(target) and w.known_obj[target] is not None:
            obj = target
            kl = w.known_obj[target]
            dest = w.agent_place if kl == HELD else (kl if kl in c.place else w.place_of(kl)
                                                     if kl in c.obj else kl)
            if kl in c.obj and w.known_obj.get(kl) is not None and w.known_obj[kl] in c.place:
                dest = w.known_obj[kl]
        else:
            tid = self.compiled.trigger_id("person_knowledge", target) or c.hidden_trigger.get(target)
            if tid:
                # same words as for any unknown id: the agent must not learn that it exists
                return self._err("unknown_entity", f"You don't know any place or object called {target[:40]!r}.",
                                 tid)
            return self._err("unknown_entity", f"You don't know any place or object called {target[:40]!r}.")
        if obj is not None and w.known_obj[obj] == HELD:
            return self._err("precondition_unmet", f"You are holding the {c.obj[obj].name}.")
        route = w.known_route(w.agent_place, dest)
        if route is None:
            if w.known_route(w.agent_place, dest, avoid_obstacles=False) is None:
                return self._err("unreachable", f"You know no route to the {c.place[dest].name}.")
            return self._err("unreachable", f"Every route you know to the {c.place[dest].name} is blocked by "
                                            "an obstacle you already found.")
        moved = False
        for cid, nxt in route:
            x = c.conn[cid]
            stop = None
            if w.blocked[cid]:
                w.learn("blocked:" + cid)
                stop = (f"The way from the {c.place[w.agent_place].name} to the {c.place[nxt].name} is blocked.",
                        self.compiled.trigger_id("blocked_path", cid))
            elif w.door[cid] == "locked":
                w.learn("locked:" + cid)
                w.known_door[cid] = "locked"
                stop = (f"The {x.kind} {cid} to the {c.place[nxt].name} is locked.",
                        self.compiled.trigger_id("locked_door", cid))
            elif w.restricted[nxt] and ("permit:" + nxt) not in w.learned:
                w.learn("restricted:" + nxt)
                stop = (f"The {c.place[nxt].name} is a restricted area: you need permission to enter.",
                        self.compiled.trigger_id("restricted_area", nxt))
            if stop:
                text = stop[0]
                if moved:
                    text = f"You walk to the {c.place[w.agent_place].name} [{w.agent_place}]. " + text
                    self.observe_here()
                return StepResult(ok=False, observation=text, error="trigger_fired" if stop[1] else
                                  "precondition_unmet", trigger=stop[1])
            if w.door[cid] == "closed":
                w.door[cid] = "open"
                w.known_door[cid] = "open"
            w.agent_place = nxt
            w.agent_near = None
            self.crossed.append(cid)
            moved = True
        text = self.describe_place()
        if obj is not None:
            if w.visible(obj) or w.obj[obj]["loc"] == HELD:
                w.agent_near = obj
                text = f"You stand next to the {c.obj[obj].name}. " + text
            else:
                w.known_obj[obj] = None
                tid = self.compiled.trigger_id("object_moved", obj)
                return StepResult(ok=False, observation=f"The {c.obj[obj].name} is not where you last saw it. "
                                  + text, error="trigger_fired" if tid else "precondition_unmet", trigger=tid)
        return self._ok(text)

    def _do_look_around(self) -> StepResult:
        return self._ok(self.describe_place())

    def _do_search(self, query: str) -> StepResult:
        w, c = self.world, self.compiled
        q = normalize(query)
        if not q:
            return self._err("bad_argument_value", "search.query has no words.")
        found = []
        for oid in c.obj_order:
            ntype, nname = c.norm_names[oid]
            if not (q in ntype or q in nname or q == oid or ntype in q):
                continue
            if w.reachable_inside(oid):
                found.append(oid)
                w.known_obj[oid] = w.obj[oid]["loc"]
                w.learned.add("seen:" + oid)
        here = w.agent_place
        w.learned.add(f"searched:{here}:{q}")
        if not found:
            tid = None
            for t in c.triggers:
                if t.kind == "person_knowledge" and t.target in c.obj and q in normalize(c.obj[t.target].type):
                    tid = t.id
            res = self._ok(f"You search the {c.place[here].name} but find no {query[:40]}.")
            res.trigger = tid
            return res
        descr = []
        for oid in found:
            loc = w.obj[oid]["loc"]
            descr.append(self._label(oid) + ("" if loc == here else f" in the {c.obj[loc].name} [{loc}]"))
        return self._ok("You find: " + ", ".join(descr) + ".")

    def _here_object(self, oid: str, verb: str) -> StepResult | None:
        w, c = self.world, self.compiled
        if not self._knows_obj(oid):
            return self._err("unknown_entity", f"You don't know any object called {oid[:40]!r}.")
        if w.obj[oid]["loc"] == HELD:
            return None
        if not w.visible(oid):
            if w.known_obj.get(oid) is not None and w.place_of(oid) != w.agent_place:
                kl = w.known_obj[oid]
                believed_here = kl == w.agent_place or (kl in c.obj and w.place_of(kl) == w.agent_place)
                if believed_here:
                    w.known_obj[oid] = None
                    tid = self.compiled.trigger_id("object_moved", oid)
                    return StepResult(ok=False, observation=f"The {c.obj[oid].name} is not here any more.",
                                      error="trigger_fired" if tid else "precondition_unmet", trigger=tid)
            return self._err("precondition_unmet", f"The {c.obj[oid].name} is not within reach here; you cannot "
                                                   f"{verb} it.")
        return None

    def _do_inspect(self, target: str) -> StepResult:
        w, c = self.world, self.compiled
        if target in c.conn and target in w.known_conns:
            x = c.conn[target]
            if w.agent_place not in (x.a, x.b):
                return self._err("precondition_unmet", f"You are not next to {target}.")
            st = w.door[target] or "open"
            if w.blocked[target]:
                w.learn("blocked:" + target)
            if st == "locked":
                w.learn("locked:" + target)
                w.known_door[target] = "locked"
            elif x.door is not None:
                w.known_door[target] = st
            extra = " It is blocked." if w.blocked[target] else ""
            w.learned.add(f"state:{target}:open={st == 'open'}")
            w.learned.add(f"state:{target}:locked={st == 'locked'}")
            w.learned.add("inspected:" + target)
            return self._ok(f"The {c.display_name(target)} is {st}.{extra}")
        bad = self._here_object(target, "inspect")
        if bad:
            return bad
        o, s = c.obj[target], w.obj[target]
        bits = []
        if o.openable:
            bits.append("locked" if s["locked"] else ("open" if s["open"] else "closed"))
            w.learned.add(f"state:{target}:open={s['open']}")
            w.learned.add(f"state:{target}:locked={s['locked']}")
        if o.device:
            w.learned.add(f"state:{target}:on={s['on']}")
            w.learned.add(f"state:{target}:broken={s['broken']}")
            bits.append("broken: it shows an error" if s["broken"] else ("on" if s["on"] else "off"))
            if s["broken"]:
                w.learned.add("broken:" + target)
        if s["heavy"]:
            bits.append("very heavy")
            w.learned.add("heavy:" + target)
        if s["fragile"]:
            bits.append("fragile")
            w.learned.add("fragile:" + target)
        text = f"The {o.name} [{target}]" + (" is " + ", ".join(bits) if bits else " looks ordinary") + "."
        if o.owner:
            text += f" It has a name tag: {c.person[o.owner].name if o.owner in c.person else o.owner}."
            w.learned.add(f"owner:{target}={o.owner}")
        for k, v in o.details.items():
            text += f" {k.capitalize()}: {v}."
        w.learned.add("inspected:" + target)
        return self._ok(text)

    def _identified(self, trig_target: str, candidates: list[str]) -> bool:
        ln = self.world.learned
        owner = self.compiled.obj[trig_target].owner
        if f"owner:{trig_target}={owner}" in ln or ("identified:" + trig_target) in ln:
            return True
        others = [x for x in candidates if x != trig_target]
        return bool(others) and all(any(f.startswith(f"owner:{x}=") for f in ln) for x in others)

    def _do_pick_up(self, object: str) -> StepResult:  # noqa: A002 - the skill's argument name
        w, c = self.world, self.compiled
        bad = self._here_object(object, "pick up")
        if bad:
            return bad
        o, s = c.obj[object], w.obj[object]
        if s["loc"] == HELD:
            return self._err("precondition_unmet", f"You already hold the {o.name}.")
        if not o.portable:
            return self._err("precondition_unmet", f"The {o.name} cannot be picked up.")
        for t in c.triggers:
            if t.kind == "ambiguous_target" and object in t.candidates and not self._identified(t.target,
                                                                                                  t.candidates):
                n = len(t.candidates)
                return StepResult(ok=False, error="trigger_fired", trigger=t.id,
                                  observation=f"There are {n} {o.type.replace('_', ' ')}s that could be meant; "
                                              "you are not sure which one is the right one.")
        if s["heavy"]:
            w.learned.add("heavy:" + object)
            tid = self.compiled.trigger_id("too_heavy", object)
            return StepResult(ok=False, observation=f"The {o.name} is too heavy to lift alone.",
                              error="trigger_fired" if tid else "precondition_unmet", trigger=tid)
        if s["fragile"] and w.holding:
            w.learned.add("fragile:" + object)
            tid = self.compiled.trigger_id("fragile_item", object)
            return StepResult(ok=False, observation=f"The {o.name} is fragile: you need both hands free to "
                                                    "carry it safely.",
                              error="trigger_fired" if tid else "precondition_unmet", trigger=tid)
        if len(w.holding) >= w.capacity:
            return self._err("precondition_unmet", "Your hands are full; put something down first.")
        s["loc"] = HELD
        s["next_to"] = None
        w.holding.append(object)
        w.known_obj[object] = HELD
        if w.agent_near == object:
            w.agent_near = None
        return self._ok(f"You pick up the {o.name}.")

    def _do_place(self, object: str, target: str) -> StepResult:  # noqa: A002
        w, c = self.world, self.compiled
        if object not in w.holding:
            if not self._knows_obj(object):
                return self._err("unknown_entity", f"You don't know any object called {object[:40]!r}.")
            return self._err("precondition_unmet", f"You are not holding the {c.obj[object].name}.")
        here = w.agent_place
        o, s = c.obj[object], w.obj[object]
        if target == here:
            s["loc"], text = here, f"You put the {o.name} down in the {c.place[here].name}."
        elif target == object:
            return self._err("bad_argument_value", "An object cannot be placed on itself.")
        elif self._knows_obj(target):
            t, ts = c.obj[target], w.obj[target]
            if ts["loc"] == HELD or not w.visible(target):
                return self._err("precondition_unmet", f"The {t.name} is not here.")
            if t.container or t.surface:
                if t.openable and not t.surface and not ts["open"]:
                    return self._err("precondition_unmet", f"The {t.name} is closed.")
                s["loc"] = target
                text = f"You put the {o.name} {'on' if t.surface else 'in'} the {t.name}."
            else:
                s["loc"], s["next_to"] = ts["loc"], target
                text = f"You put the {o.name} next to the {t.name}."
        elif target in c.place and target in w.known_places:
            return self._err("precondition_unmet", f"You are not in the {c.place[target].name}.")
        else:
            return self._err("unknown_entity", f"You don't know any place or object called {target[:40]!r}.")
        w.holding.remove(object)
        w.known_obj[object] = s["loc"]
        return self._ok(text)

    def _door_here(self, cid: str) -> bool:
        x = self.compiled.conn[cid]
        return self.world.agent_place in (x.a, x.b)

    def _do_open(self, target: str) -> StepResult:
        w, c = self.world, self.compiled
        if target in c.conn and target in w.known_conns:
            if c.conn[target].door is None:
                return self._err("precondition_unmet", f"{target} has no door to open.")
            if not self._door_here(target):
                return self._err("precondition_unmet", f"You are not next to {target}.")
            st = w.door[target]
            if st == "open":
                return self._err("precondition_unmet", f"The {c.display_name(target)} is already open.")
            if st == "locked":
                key = next((k for k in w.holding if c.obj[k].opens == target), None)
                if key is None:
                    w.learn("locked:" + target)
                    w.known_door[target] = "locked"
                    tid = self.compiled.trigger_id("locked_door", target)
                    return StepResult(ok=False, observation=f"The {c.display_name(target)} is locked.",
                                      error="trigger_fired" if tid else "precondition_unmet", trigger=tid)
                w.door[target] = w.known_door[target] = "open"
                w.unlearn("locked:" + target)
                return self._ok(f"You unlock the {c.display_name(target)} with the {c.obj[key].name} and open it.")
            w.door[target] = w.known_door[target] = "open"
            return self._ok(f"You open the {c.display_name(target)}.")
        bad = self._here_object(target, "open")
        if bad:
            return bad
        o, s = c.obj[target], w.obj[target]
        if not o.openable:
            return self._err("precondition_unmet", f"The {o.name} cannot be opened.")
        if s["open"]:
            return self._err("precondition_unmet", f"The {o.name} is already open.")
        if s["locked"]:
            key = next((k for k in w.holding if c.obj[k].opens == target), None)
            if key is None:
                return self._err("precondition_unmet", f"The {o.name} is locked.")
            s["locked"] = False
        s["open"] = True
        w.learned.discard(f"state:{target}:open=False")
        w.learned.add(f"state:{target}:open=True")
        seen = [self._label(x) for x in c.obj_order if w.obj[x]["loc"] == target]
        for x in c.obj_order:
            if w.obj[x]["loc"] == target:
                w.known_obj[x] = target
                w.learned.add("seen:" + x)
        return self._ok(f"You open the {o.name}." + (" Inside: " + ", ".join(seen) + "." if seen else
                                                     " It is empty."))

    def _do_close(self, target: str) -> StepResult:
        w, c = self.world, self.compiled
        if target in c.conn and target in w.known_conns:
            if c.conn[target].door is None or not self._door_here(target):
                return self._err("precondition_unmet", f"There is no door {target} next to you.")
            if w.door[target] != "open":
                return self._err("precondition_unmet", f"The {c.display_name(target)} is not open.")
            w.door[target] = w.known_door[target] = "closed"
            return self._ok(f"You close the {c.display_name(target)}.")
        bad = self._here_object(target, "close")
        if bad:
            return bad
        o, s = c.obj[target], w.obj[target]
        if not o.openable or not s["open"]:
            return self._err("precondition_unmet", f"The {o.name} is not open.")
        s["open"] = False
        w.learned.discard(f"state:{target}:open=True")
        w.learned.add(f"state:{target}:open=False")
        return self._ok(f"You close the {o.name}.")

    def _do_operate(self, device: str, action: str) -> StepResult:
        w, c = self.world, self.compiled
        bad = self._here_object(device, "operate")
        if bad:
            return bad
        o, s = c.obj[device], w.obj[device]
        if not o.device:
            return self._err("precondition_unmet", f"The {o.name} is not a device.")
        want = action == "turn_on"
        if s["on"] == want:
            return self._err("precondition_unmet", f"The {o.name} is already {'on' if want else 'off'}.")
        if want and s["broken"]:
            w.learned.add("broken:" + device)
            tid = self.compiled.trigger_id("device_malfunction", device)
            return StepResult(ok=False, observation=f"The {o.name} beeps and shows an error; it does not start.",
                              error="trigger_fired" if tid else "precondition_unmet", trigger=tid)
        s["on"] = want
        return self._ok(f"You turn the {o.name} {'on' if want else 'off'}.")

    def _person_here(self, person: str, nearby: bool = True) -> StepResult | None:
        w, c = self.world, self.compiled
        known = person in c.person and person in w.known_person
        if not known:
            return self._err("unknown_entity", f"You don't know anyone called {person[:40]!r}.")
        if nearby and w.person_place[person] != w.agent_place:
            return self._err("precondition_unmet", f"{c.person[person].name} is not here.")
        return None

    def _do_talk_to(self, person: str, topic: str, message: str = "") -> StepResult:
        bad = self._person_here(person)
        if bad:
            return bad
        return self.human.talk(self.world, person, topic, message)

    def _do_ask_for_help(self, person: str, request: str, target: str, reason: str,
                         destination: str = "") -> StepResult:
        persona = self.compiled.persona.get(person)
        rule = next((r for r in persona.policy if r.request == request), None) if persona else None
        bad = self._person_here(person, nearby=rule.requires_nearby if rule else True)
        if bad:
            return bad
        return self.human.help_with(self.world, person, request, target, reason, destination)

    def _do_report(self, answer: str) -> StepResult:
        self.world.reports.append(answer)
        return self._ok(f"You report: {answer}")

    def _do_finish(self, summary: str = "") -> StepResult:
        return StepResult(ok=True, observation="You end the task.")

    # ------------------------------------------------------------------ predicates

    def holds(self, p) -> bool:
        w, k = self.world, p.kind
        if k == "agent_at":
            return w.agent_place == p.place
        if k == "agent_near":
            return w.agent_near == p.object
        if k == "holding":
            return p.object in w.holding
        if k == "object_at":
            s = w.obj[p.object]
            if s["loc"] == HELD:
                return False
            return s["loc"] == p.location if p.location in self.compiled.obj else w.place_of(p.object) == p.location
        if k == "next_to":
            s = w.obj[p.object]
            return s["loc"] != HELD and s["next_to"] == p.other
        if k == "object_state":
            return w.obj[p.object][p.field] == p.value
        if k == "door_open":
            return w.door[p.door] == "open"
        if k == "observed":  # seen (or told) this episode, and the agent knows where it really is
            return (("seen:" + p.object) in w.learned or f"told_where:{p.object}" in w.learned) and \
                w.known_obj.get(p.object) == w.obj[p.object]["loc"]
        if k == "inspected":
            return ("inspected:" + p.object) in w.learned
        if k == "told":
            return ("told:" + p.fact) in w.learned
        if k == "reported":
            return bool(w.reports) and report_matches(w.reports[-1], p.value, p.aliases, p.excludes)
        raise ValueError(f"unknown predicate kind {k!r}")

    def _latch(self) -> list[str]:
        """Subgoals are met in order; each stays met once reached."""
        met, sg = [], self.task.subgoals
        while self.world.latched < len(sg) and self.holds(sg[self.world.latched].predicate):
            met.append(sg[self.world.latched].id)
            self.world.latched += 1
        if met:
            self.world.touch()
        return met
