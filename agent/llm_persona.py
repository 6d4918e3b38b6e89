"""LLM-backed persona: a chat model words what people in the sandbox say; the rules still decide.

`LLMHumanAgent` is a `HumanAgent` whose `phrase` (refusals and the like) and `knowledge_text` (what a person
tells) are rewritten by a model in the persona's role and style. Whether a person helps, what they reveal
and every world effect stay with the rule-driven base class, so the world stays consistent and the episode
stays solvable. The model's line is used only if what the agent needs survives it:

* every id the rule line shows in brackets (`[mug_1]`) is there verbatim, and every place, object and person
  name it mentions is there (compared with `sandbox.text.normalize`);
* a fact's answer can still be reported: the line passes `report_matches` for the answer (the teacher reports
  what it was told);
* the word "again" is there exactly when the rule line has it (it is how a busy person says "ask me again").

Otherwise, and on any `ModelError`, the rule line is used and counted in `fallbacks`. Lines are cached by
(person, key, required content), in `cache` if one is shared, so an episode is deterministic and asking the
same thing twice costs no second request.

    ctrl = EnvController(task, human=LLMHumanAgent(Compiled(task), client))
"""

from __future__ import annotations

import re
from collections import Counter

from agent.models import ChatModel, ModelError
from sandbox.human import HumanAgent
from sandbox.schema import TaskInstance
from sandbox.text import normalize, report_matches
from sandbox.world import Compiled

_BRACKET_ID = re.compile(r"\[([A-Za-z0-9_\-]+)\]")
# words a reader of the reply acts on: the teacher takes a refusal that says "again" as "busy, ask again"
SIGNAL_WORDS = ("again",)
MAX_LINE_CHARS = 300


def _has(text_norm: str, phrase: str) -> bool:
    p = normalize(phrase)
    return bool(p) and f" {p} " in text_norm


class LLMHumanAgent(HumanAgent):
    def __init__(self, compiled: Compiled | TaskInstance, client: ChatModel, cache: dict | None = None,
                 max_tokens: int = 96):
        super().__init__(compiled if isinstance(compiled, Compiled) else Compiled(compiled))
        self.client = client
        self.cache: dict = {} if cache is None else cache
        self.max_tokens = max_tokens
        self.requests = 0
        self.fallbacks = 0
        self.fallback_reasons: Counter = Counter()
        c = self.compiled
        self._names = sorted({p.name for p in c.place.values()} | {o.name for o in c.obj.values()} |
                             {p.name for p in c.person.values()}, key=lambda n: (-len(n), n))

    # ----------------------------------------------------------------- the two wording hooks

    def phrase(self, person: str, key: str) -> str:
        return self._reword(person, "phrase:" + key, super().phrase(person, key), answer=None)

    def knowledge_text(self, person: str, key: str) -> str:
        fact = self.compiled.fact.get(key)
        return self._reword(person, "knows:" + key, super().knowledge_text(person, key),
                            answer=fact.answer if fact else None)

    # ----------------------------------------------------------------- what must survive

    def required(self, rule: str, answer: str | None) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
        """(ids kept verbatim, names kept, the fact answer) for one rule line."""
        ids = tuple(dict.fromkeys(f"[{m}]" for m in _BRACKET_ID.findall(rule)))
        rule_norm = f" {normalize(_BRACKET_ID.sub(' ', rule))} "
        names, covered = [], rule_norm
        for n in self._names:  # longest first, so "storage room" is required rather than "room" as well
            if _has(covered, n):
                names.append(n)
                covered = covered.replace(f" {normalize(n)} ", " | ")
        return ids, tuple(names), answer

    def problem(self, line: str, rule: str, need: tuple) -> str | None:
        """Why a reworded line cannot replace the rule line (None if it can)."""
        ids, names, answer = need
        if not line:
            return "empty"
        if len(line) > MAX_LINE_CHARS:
            return "too_long"
        if any(i not in line for i in ids):
            return "lost_id"
        line_norm = f" {normalize(line)} "
        if any(not _has(line_norm, n) for n in names):
            return "lost_name"
        if answer is not None and not report_matches(line, answer, []):
            return "lost_answer"
        rule_norm = f" {normalize(rule)} "
        if any(_has(rule_norm, w) != _has(line_norm, w) for w in SIGNAL_WORDS):
            return "changed_signal"
        return None

    # ----------------------------------------------------------------- asking the model

    def prompt(self, person: str, rule: str, need: tuple) -> list[dict]:
        persona = self.compiled.persona.get(person)
        who = self.compiled.person[person]
        style = persona.style if persona else "friendly"
        ids, names, answer = need
        keep = [*ids, *names] + ([answer] if answer else [])
        scene = self.compiled.task.scene
        rules = [f"You are {who.name}, the {who.role}, in a {scene} scene. You speak in a {style} way.",
                 "Say the line you are given in your own words, as you would to someone who asked you: one or two "
                 "short sentences with the same meaning. Add no new facts, places or promises.",
                 "Reply with the line only, without quotes."]
        if keep:
            rules.append("Keep these exactly as written: " + "; ".join(keep) + ".")
        if answer:
            rules.append("State the answer plainly in at most 16 words, without words like not, no or never.")
        if any(_has(f" {normalize(rule)} ", w) for w in SIGNAL_WORDS):
            rules.append("Keep the word 'again'.")
        else:
            rules.append("Do not use the word 'again'.")
        return [{"role": "system", "content": " ".join(rules)}, {"role": "user", "content": rule}]

    def _reword(self, person: str, key: str, rule: str, answer: str | None) -> str:
        need = self.required(rule, answer)
        cache_key = (person, key, rule, need)
        hit = self.cache.get(cache_key)
        if hit is not None:
            return hit
        self.requests += 1
        try:
            reply = self.client.chat(self.prompt(person, rule, need), max_tokens=self.max_tokens, seed=0)
            line = " ".join(reply.text.split()).strip().strip('"').strip().replace('"', "'")
            why = self.problem(line, rule, need)
        except ModelError as e:
            line, why = rule, f"model_error:{e.kind}"
        if why is not None:
            self.fallbacks += 1
            self.fallback_reasons[why] += 1
            line = rule
        self.cache[cache_key] = line
        return line
