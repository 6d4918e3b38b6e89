"""HumanAgent: people in the sandbox answer help requests and may act on the world.

The default is rule-driven and deterministic: a persona's capabilities, knowledge and assistance policy
(state a reason, only once, only if nearby, busy until asked again) decide the reply and the effect. The
LLM-backed persona (`agent.llm_persona`) plugs in by subclassing and overriding `phrase` and
`knowledge_text`, keeping the same effects so the world stays consistent.
"""

from __future__ import annotations

from sandbox.skills import StepResult
from sandbox.text import normalize
from sandbox.world import HELD, Compiled, World

_STYLE = {
    "friendly": {"busy": "Oh, sorry, I'm in the middle of something. Could you ask me again in a moment?",
                 "no_reason": "Happy to help, but why do you need that?",
                 "cannot": "Sorry, I can't help with that.",
                 "once": "I already did that for you once; I can't do it again.",
                 "unknown": "Hmm, I'm afraid I don't know.",
                 "pointless": "That doesn't seem to need any help."},
    "terse": {"busy": "Busy. Ask again later.", "no_reason": "Why?", "cannot": "Can't do that.",
              "once": "Already did that.", "unknown": "No idea.", "pointless": "Doesn't need it."},
    "formal": {"busy": "I am occupied at the moment; please ask me again shortly.",
               "no_reason": "I shall need a reason for that request.",
               "cannot": "I regret that this is not within my remit.",
               "once": "I have already assisted with that once.",
               "unknown": "I am afraid I cannot tell you.", "pointless": "That does not appear to require help."},
}


class HumanAgent:
    def __init__(self, compiled: Compiled):
        self.compiled = compiled

    # ----------------------------------------------------------------- language

    def phrase(self, person: str, key: str) -> str:
        persona = self.compiled.persona.get(person)
        style = persona.style if persona else "friendly"
        return _STYLE[style][key]

    def _say(self, person: str, text: str, ok: bool = True,
             error: str | None = None, trigger: str | None = None) -> StepResult:
        return StepResult(ok=ok, observation=f'{self.compiled.person[person].name} says: "{text}"', error=error,
                          trigger=trigger)

    def _busy(self, world: World, person: str) -> StepResult | None:
        persona = self.compiled.persona.get(person)
        w = world
        if persona and w.asks[person] < persona.busy_until_asked:
            w.asks[person] += 1
            tid = self.compiled.trigger_id("person_busy", person)
            return self._say(person, self.phrase(person, "busy"), ok=False, error="refused", trigger=tid)
        return None

    # ----------------------------------------------------------------- knowledge

    def match_topic(self, person: str, topic: str) -> str | None:
        """Which of the person's knowledge keys the topic refers to (id, type, name or fact question)."""
        persona = self.compiled.persona.get(person)
        if not persona:
            return None
        q = normalize(topic)
        if not q:
            return None
        if topic in persona.knowledge:
            return topic
        names = []
        for key in persona.knowledge:
            if key in self.compiled.obj:
                names += [(key, self.compiled.obj[key].type), (key, self.compiled.obj[key].name)]
            if key in self.compiled.fact:
                names.append((key, self.compiled.fact[key].question))
            if key in self.compiled.place:
                names.append((key, self.compiled.place[key].name))
            names.append((key, key))
        for key, n in names:  # exact names first, then the closest containing match
            if normalize(n) == q:
                return key
        normed = [(key, normalize(n)) for key, n in names]
        loose = [(len(n), key) for key, n in normed if n and (q in n or n in q)]
        return min(loose)[1] if loose else None

    def knowledge_text(self, person: str, key: str) -> str:
        """How the person words one piece of knowledge (the LLM persona rewords it, keeping what matters)."""
        return self.compiled.persona[person].knowledge[key]

    def tell(self, world: World, person: str, key: str) -> StepResult:
        """Share one piece of knowledge; what it reveals enters the agent's belief."""
        persona = self.compiled.persona[person]
        w = world
        for hid in persona.reveals.get(key, []):
            w.hidden.discard(hid)
            if hid in self.compiled.place:
                w.known_places.add(hid)
            elif hid in self.compiled.conn:
                w.known_conns.add(hid)
                x = self.compiled.conn[hid]
                w.known_places.update((x.a, x.b))
                hidden_lock = w.door[hid] == "locked" and not self.compiled.locks_visible
                w.known_door[hid] = "closed" if hidden_lock else w.door[hid]
        if key in self.compiled.obj:
            w.known_obj[key] = w.obj[key]["loc"] if w.obj[key]["loc"] != HELD else HELD
            w.learned.add("told_where:" + key)
            o = self.compiled.obj[key]
            if o.owner:
                w.learned.add(f"owner:{key}={o.owner}")
                w.learned.add("identified:" + key)
        if key in self.compiled.fact:
            w.learned.add("told:" + key)
        w.learned.add(f"asked:{person}:{key}")
        text = self.knowledge_text(person, key)
        w.notes[key] = f"{self.compiled.person[person].name}: {text}"
        return self._say(person, text)

    def talk(self, world: World, person: str, topic: str, message: str) -> StepResult:
        busy = self._busy(world, person)
        if busy:
            return busy
        key = self.match_topic(person, topic)
        world.learned.add(f"talked:{person}")
        if key is None:
            return self._say(person, self.phrase(person, "unknown"))
        return self.tell(world, person, key)

    # ----------------------------------------------------------------- acting on the world

    @staticmethod
    def _contains(w, outer: str, inner: str) -> bool:
        """Whether `inner` sits (at any depth) inside `outer`."""
        loc = w.obj[inner]["loc"]
        for _ in range(16):
            if loc == outer:
                return True
            if loc not in w.obj:
                return False
            loc = w.obj[loc]["loc"]
        return False

    def help_with(self, world: World, person: str, request: str, target: str, reason: str,
                  destination: str) -> StepResult:
        c, w = self.compiled, world
        persona = c.persona.get(person)
        rule = next((r for r in persona.policy if r.request == request), None) if persona else None
        if persona is None or rule is None or request not in persona.capabilities:
            return self._say(person, self.phrase(person, "cannot"), ok=False, error="refused")
        busy = self._busy(world, person)
        if busy:
            return busy
        if rule.requires_reason and len(normalize(reason).split()) < 2:
            return self._say(person, self.phrase(person, "no_reason"), ok=False, error="refused")
        if rule.once and (person, request) in {(p, r) for p, r, _ in w.helped}:
            return self._say(person, self.phrase(person, "once"), ok=False, error="refused")
        name = c.person[person].name

        def done(text: str) -> StepResult:
            w.helped.add((person, request, target))
            return self._say(person, text)

        if request == "locate":
            key = self.match_topic(person, target)
            if key is None:
                return self._say(person, self.phrase(person, "unknown"))
            w.helped.add((person, request, target))
            return self.tell(world, person, key)
        if request == "unlock":
            if target in c.conn and target in w.known_conns:
                if w.door[target] != "locked":
                    return self._say(person, self.phrase(person, "pointless"), ok=False, error="refused")
                w.door[target] = w.known_door[target] = "open"
                w.unlearn("locked:" + target)
                return done(f"Here, I've unlocked it for you. ({name} unlocks and opens the {c.display_name(target)}.)")
            if target in c.obj and target in w.known_obj and w.obj[target]["locked"]:
                w.obj[target]["locked"] = False
                return done(f"There you go. ({name} unlocks the {c.obj[target].name}.)")
            return self._say(person, self.phrase(person, "pointless"), ok=False, error="refused")
        if request == "clear":
            if target in c.conn and target in w.known_conns and w.blocked[target]:
                w.blocked[target] = False
                w.unlearn("blocked:" + target)
                return done(f"Let me move that out of the way. ({name} clears the {c.display_name(target)}.)")
            return self._say(person, self.phrase(person, "pointless"), ok=False, error="refused")
        if request == "permission":
            if target in c.place and target in w.known_places and w.restricted[target]:
                w.learn("permit:" + target)
                w.unlearn("restricted:" + target)
                return done(f"All right, you may go into the {c.place[target].name}.")
            return self._say(person, self.phrase(person, "pointless"), ok=False, error="refused")
        if request == "repair":
            if target in c.obj and target in w.known_obj and w.obj[target]["broken"]:
                w.obj[target]["broken"] = False
                w.learned.discard("broken:" + target)
                return done(f"I know this one. ({name} repairs the {c.obj[target].name}.)")
            return self._say(person, self.phrase(person, "pointless"), ok=False, error="refused")
        if request == "carry":
            if target not in c.obj or target not in w.known_obj or not c.obj[target].portable:
                return self._say(person, self.phrase(person, "cannot"), ok=False, error="refused")
            if w.obj[target]["loc"] == HELD or w.known_obj.get(target) is None:
                return self._say(person, "Where is it? Show me first.", ok=False, error="refused")
            dest = destination
            inside = dest in c.obj and (dest == target or self._contains(w, target, dest))
            if inside:
                return self._say(person, "I can't put it inside itself.", ok=False, error="refused")
            if dest in c.place and dest in w.known_places:
                loc = dest
            elif dest in c.obj and dest in w.known_obj and (c.obj[dest].surface or c.obj[dest].container) \
                    and not w.obj[dest]["locked"]:
                loc = dest
                if c.obj[dest].openable and not c.obj[dest].surface:
                    w.obj[dest]["open"] = True  # they open it to put the thing inside
            else:
                return self._say(person, "Where should I take it?", ok=False, error="refused")
            w.obj[target]["loc"] = loc
            w.obj[target]["next_to"] = None
            w.known_obj[target] = loc
            w.learned.add("told_where:" + target)  # the agent hears where it is being taken
            w.person_place[person] = w.place_of(target)
            w.known_person[person] = w.person_place[person]  # the agent heard where they took it
            return done(f"I'll carry it for you. ({name} carries the {c.obj[target].name} to the "
                        f"{c.display_name(loc)}.)")
        return self._say(person, self.phrase(person, "cannot"), ok=False, error="refused")
