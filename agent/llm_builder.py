"""LLM builder: a chat model writes an instruction's Easy, Medium and Hard variants as sandbox JSON.

The model gets the scene vocabulary, the reply's JSON schema and one real example from the procedural
builder, and answers in JSON mode. Its reply is data only: it is parsed with pydantic (`TaskReply`, then each
variant as a `VariantReply`), its references are checked, and every variant goes through the procedural
builder's own `validate_instance` (solved by the oracle within budget, every trigger reached and mattering,
no leaks; the belief-only teacher's result is counted). A rejected variant is asked for again, with the
reason, at most `max_attempts` times in all. Nothing the model writes is executed. Given the same replies,
the same tasks come out.

    builder = LLMBuilder(OpenAIClient("qwen", base_url=...), BuildConfig(), [load_scene("home")])
    tasks = builder.build(seed, "train")      # builder.stats: BuildStats, as the procedural builder keeps
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from pydantic import Field, ValidationError

from agent.models import ChatModel, ModelError
from sandbox.builder import (
    INSTRUCTION_KINDS, BuildConfig, BuildStats, ProceduralBuilder, _h, leaks, scene_connection_id, validate_instance,
)
from sandbox.controller import EnvController
from sandbox.schema import (
    DIFFICULTIES, AgentView, Difficulty, EnvState, FailureTrigger, GoalStep, HumanPersona, InstructionKind,
    Predicate, ScenePack, Strict, Subgoal, TaskInstance,
)
from sandbox.skills import SKILLS
from sandbox.world import Compiled

# ----------------------------------------------------------------------------- what the model writes


class VariantReply(Strict):
    """One difficulty variant as the model writes it. Ids, split, seed, budget and optimal steps are the
    builder's to set, not the model's."""

    env_state: EnvState
    failure_triggers: list[FailureTrigger] = Field(default_factory=list)
    human_persona: list[HumanPersona] = Field(default_factory=list)
    goal: list[GoalStep]
    subgoals: list[Subgoal]
    success: list[Predicate]
    agent_view: AgentView


class TaskReply(Strict):
    """The whole reply. Variants are checked one by one, so one broken variant spares the others."""

    instruction: str = Field(min_length=1, max_length=400)
    kind: InstructionKind
    variants: dict[Difficulty, dict[str, Any]]


class _VariantsShape(Strict):  # only for the JSON schema shown to the model
    easy: VariantReply | None = None
    medium: VariantReply | None = None
    hard: VariantReply | None = None


class _ReplyShape(Strict):  # only for the JSON schema shown to the model
    instruction: str
    kind: InstructionKind
    variants: _VariantsShape


def _drop_titles(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_titles(v) for k, v in node.items() if k != "title"}
    if isinstance(node, list):
        return [_drop_titles(v) for v in node]
    return node


def reply_schema() -> dict:
    """The JSON schema of a reply (titles dropped: they repeat the names and cost tokens)."""
    return _drop_titles(_ReplyShape.model_json_schema())


VARIANT_FIELDS = tuple(VariantReply.model_fields)

# ----------------------------------------------------------------------------- checks the schema cannot make


def _predicate_refs(p, ids: dict[str, set[str]]) -> list[str]:
    bad = []
    for field, pool in (("object", "objects"), ("other", "objects"), ("place", "places"), ("door", "connections"),
                        ("fact", "facts")):
        v = getattr(p, field, None)
        if v is not None and v not in ids[pool]:
            bad.append(f"{p.kind}.{field} {v!r} is not in env_state.{pool}")
    loc = getattr(p, "location", None)
    if loc is not None and loc not in ids["places"] | ids["objects"]:
        bad.append(f"{p.kind}.location {loc!r} is neither a place nor an object")
    return bad


def reference_problems(task: TaskInstance) -> list[str]:
    """References the schema's own validators do not check and the controller relies on: the agent's view,
    goal and predicates name real entities, and each trigger targets the kind of entity its kind acts on."""
    st = task.env_state
    ids = {"places": {p.id for p in st.places}, "connections": {c.id for c in st.connections},
           "objects": {o.id for o in st.objects}, "people": {p.id for p in st.people},
           "facts": {f.id for f in st.facts}}
    obj = {o.id: o for o in st.objects}
    out = []
    v = task.agent_view
    for kind, entries in (("places", v.places), ("connections", v.connections), ("objects", v.objects),
                          ("people", v.people)):
        for e in entries:
            if e.id not in ids[kind]:
                out.append(f"agent_view.{kind}: {e.id!r} is not in env_state.{kind}")
    for e in v.places:
        out += [f"agent_view.places[{e.id}].landmarks: {x!r} is not an object" for x in e.landmarks
                if x not in ids["objects"]]
    for e in v.objects:
        if e.last_seen is not None and e.last_seen not in ids["places"] | ids["objects"]:
            out.append(f"agent_view.objects[{e.id}].last_seen {e.last_seen!r} is neither a place nor an object")
    for e in v.people:
        if e.last_seen not in ids["places"]:
            out.append(f"agent_view.people[{e.id}].last_seen {e.last_seen!r} is not a place")
    for g in task.goal:
        for field, pool in (("place", "places"), ("container", "objects"), ("door", "connections"),
                            ("person", "people"), ("fact", "facts")):
            val = getattr(g, field)
            if val is not None and val not in ids[pool]:
                out.append(f"goal {g.op}.{field} {val!r} is not in env_state.{pool}")
        for ref in (g.object, g.next_to):
            if ref is not None and ref.id is not None and ref.id not in ids["objects"]:
                out.append(f"goal {g.op}: object id {ref.id!r} is not in env_state.objects")
            if ref is not None and ref.owner is not None and ref.owner not in ids["people"]:
                out.append(f"goal {g.op}: owner {ref.owner!r} is not in env_state.people")
    for s in task.subgoals:
        out += [f"subgoals[{s.id}]: {m}" for m in _predicate_refs(s.predicate, ids)]
    for i, p in enumerate(task.success):
        out += [f"success[{i}]: {m}" for m in _predicate_refs(p, ids)]
    for h in task.human_persona:
        for topic, hidden in h.reveals.items():
            out += [f"human_persona[{h.person}].reveals[{topic}]: {x!r} is neither a place nor a connection"
                    for x in hidden if x not in ids["places"] | ids["connections"]]
        if h.capabilities and not h.policy:
            out.append(f"human_persona[{h.person}]: capabilities without a policy rule never help")
    revealed = {topic for h in task.human_persona for topic in h.reveals}
    shown = {o.id for o in v.objects}
    for t in task.failure_triggers:
        k, x = t.kind, t.target
        if k in ("locked_door", "blocked_path") and x not in ids["connections"]:
            out.append(f"failure_triggers[{t.id}]: a {k} targets a connection, not {x!r}")
        elif k == "restricted_area" and x not in ids["places"]:
            out.append(f"failure_triggers[{t.id}]: a restricted_area targets a place, not {x!r}")
        elif k == "person_busy" and x not in ids["people"]:
            out.append(f"failure_triggers[{t.id}]: a person_busy targets a person, not {x!r}")
        elif k in ("device_malfunction", "too_heavy", "fragile_item", "object_moved", "ambiguous_target",
                   "person_knowledge") and x not in ids["objects"]:
            out.append(f"failure_triggers[{t.id}]: a {k} targets an object, not {x!r}")
        elif k == "device_malfunction" and not obj[x].device:
            out.append(f"failure_triggers[{t.id}]: {x!r} is not a device")
        elif k == "object_moved" and x not in shown:
            out.append(f"failure_triggers[{t.id}]: a moved object must be on the agent's map at its old place")
        elif k == "person_knowledge" and x not in revealed:
            out.append(f"failure_triggers[{t.id}]: no persona reveals where {x!r} is")
        elif k == "ambiguous_target" and (x not in t.candidates or len(t.candidates) < 2
                                          or any(c not in ids["objects"] for c in t.candidates)):
            out.append(f"failure_triggers[{t.id}]: candidates must list {x!r} and at least one look-alike object")
    return out


def trigger_count_problem(difficulty: str, n: int, cfg: BuildConfig) -> str | None:
    if difficulty == "easy" and n:
        return f"an easy variant has no failure_triggers; this one has {n}"
    if difficulty == "medium" and n != 1:
        return f"a medium variant has exactly one failure trigger; this one has {n}"
    if difficulty == "hard" and n < cfg.hard_min_triggers:
        return f"a hard variant has at least {cfg.hard_min_triggers} failure triggers; this one has {n}"
    return None


_WHY = {
    "oracle_failed": "the oracle expert, which sees the true env_state, could not complete it within the step "
                     "budget: every subgoal must be reachable in order and every success predicate must hold, "
                     "with a recovery for each obstacle (a key on the reachable side, a capable helper whose policy "
                     "has that request)",
    "over_budget": "the shortest solution is longer than the step budget allows",
    "clean_variant_unsolved": "with every obstacle removed, the task still cannot be solved",
    "leak": "the agent's initial view gives away hidden information",
}


def explain(reason: str, task: TaskInstance | None = None) -> str:
    """The feedback sentence for a rejection code (the code is what BuildStats counts)."""
    if reason.startswith("trigger_not_reached:"):
        return (f"the plan that ignores obstacles never meets the {reason.split(':', 1)[1]} trigger: put the "
                "obstacle on the route the task needs")
    if reason.startswith("trigger_does_not_matter:"):
        return (f"with only the {reason.split(':', 1)[1]} obstacle, the plan that ignores obstacles still "
                "succeeds: the obstacle must stop the task until the agent recovers")
    if reason == "leak" and task is not None:
        return _WHY["leak"] + ": " + "; ".join(leaks(task, EnvController(Compiled(task)).reset()))
    return _WHY.get(reason, reason)


# ----------------------------------------------------------------------------- the builder


def possible_kinds(scene: ScenePack) -> list[str]:
    """Instruction kinds this scene can hold (a device to operate, a person who knows a fact, ...)."""
    kinds = []
    for k in INSTRUCTION_KINDS:
        if k == "state_inspection" and not any(f.device or f.openable for f in scene.fixtures):
            continue
        if k == "operate" and not any(f.device for f in scene.fixtures):
            continue
        if k == "ask_person" and not any(f.holders for f in scene.facts):
            continue
        kinds.append(k)
    return kinds


SYSTEM_PROMPT = (
    "You write tasks for a text sandbox in which an embodied agent acts by calling skills. A task is one "
    "instruction in one scene, written as JSON in the sandbox schema at several difficulties. Every variant is "
    "checked by running an expert planner on it; variants that fail are rejected. Reply with one JSON object "
    "and nothing else."
)

_RULES = """Difficulties:
- easy: no failure_triggers.
- medium: exactly one failure trigger the agent can recover from.
- hard: at least {hard_min} failure triggers, nested: each on the route the previous obstacle forces (the key
  behind a blocked path); a helper the plan needs may be busy until asked twice (person_busy).
Every variant must pass these checks:
- The oracle expert, which sees env_state, completes it: the subgoals in order, then every success predicate.
- Each failure trigger is met by the plan that ignores all obstacles, and that plan fails with that obstacle
  alone. The physical fact lives in env_state (a locked door, a heavy object, a broken device, a restricted
  or hidden place); the trigger names it. Targets: locked_door and blocked_path a connection; restricted_area
  a place; device_malfunction a device; too_heavy, fragile_item an object; object_moved an object the
  agent_view shows at its old place; ambiguous_target an object plus `candidates` (it and its look-alikes,
  owned by different people); person_knowledge an object in a hidden place that a persona `reveals`;
  person_busy a person whose persona has busy_until_asked >= 1.
- Every obstacle has a recovery in the world: a key (an object whose `opens` is the door) where the agent can
  reach it, or a person whose persona has the capability and a policy rule for the request.
- agent_view is the map the agent starts with: the places, connections, fixtures, people and some items it
  knows; never hidden places or connections, trigger ids, conditions, effects or recoveries, or fact answers;
  a searched-for object is not on it; a locked door is shown closed unless the scene's locks are visible.
- Ids are the scene's ids below (connection ids as given); new objects (keys, look-alikes) get fresh ids."""


class LLMBuilder:
    """Instruction seed -> validated [easy, medium, hard] instances written by a chat model.

    Implements `sandbox.builder.InstanceBuilder` like `ProceduralBuilder`, over several scene packs: the seed
    picks the scene (`seed % len(scenes)`) unless `scene=` names one, and suggests an instruction kind the
    scene can hold. `stats` (a `BuildStats`) counts each variant once: accepted, or rejected with the reason
    of its last attempt; `attempt_reasons` counts the reason of every rejected attempt, and `attempts` logs
    them as (scene, seed, difficulty, attempt, reason).
    """

    def __init__(self, client: ChatModel, config: BuildConfig, scenes: list[ScenePack], max_attempts: int = 3,
                 stats: BuildStats | None = None, max_tokens: int = 16_000, example_seed: int = 0):
        if not scenes:
            raise ValueError("LLMBuilder: at least one scene pack")
        if max_attempts < 1:
            raise ValueError(f"LLMBuilder: max_attempts must be >= 1, not {max_attempts}")
        self.client, self.cfg, self.max_attempts, self.max_tokens = client, config, max_attempts, max_tokens
        self.scenes = {s.id: s for s in scenes}
        self.scene_order = [s.id for s in scenes]
        self.stats = stats or BuildStats()
        self.attempt_reasons: Counter = Counter()
        self.attempts: list[tuple[str, int, str, int, str]] = []
        self.example_seed = example_seed
        self._examples: dict[str, str] = {}
        self._written: dict[str, list[str]] = {s.id: [] for s in scenes}
        self._schema = json.dumps(reply_schema(), separators=(",", ":"))

    # ------------------------------------------------------------------ the prompt

    def example(self, scene: ScenePack) -> str:
        """One real reply: the procedural builder's variant with the most obstacles, for this scene."""
        if scene.id not in self._examples:
            proc = ProceduralBuilder(scene, self.cfg, BuildStats())  # its own stats: not this build's
            best = None
            for seed in range(self.example_seed, self.example_seed + 20):
                tasks = proc.build(seed, "train")
                if tasks:
                    best = max(tasks, key=lambda t: len(t.failure_triggers))
                    if best.difficulty != "easy":
                        break
            if best is None:
                raise ValueError(f"LLMBuilder: the procedural builder found no example task for scene {scene.id!r}")
            example = {"instruction": best.instruction, "kind": best.kind,
                       "variants": {best.difficulty: variant_json(best)}}
            self._examples[scene.id] = json.dumps(example, separators=(",", ":"))
        return self._examples[scene.id]

    @staticmethod
    def vocabulary(scene: ScenePack) -> str:
        data = scene.model_dump(mode="json", exclude_defaults=True)
        for sc, entry in zip(scene.connections, data["connections"], strict=True):
            entry["id"] = scene_connection_id(scene, sc)
        return json.dumps(data, separators=(",", ":"))

    def messages(self, scene: ScenePack, kind: str, difficulties: tuple[str, ...], instruction: str | None) -> list:
        skills = "; ".join(f"{s.name}({', '.join(p.name for p in s.params)})" for s in SKILLS.values())
        avoid = self._written[scene.id][-20:]
        what = (f"Write the variants {', '.join(difficulties)} of this instruction: {instruction!r}."
                if instruction else
                f"Write one new instruction of kind {kind!r} in this scene and its variants {', '.join(difficulties)}.")
        parts = [f"Scene {scene.id!r}: {scene.description}",
                 f"Scene vocabulary (JSON): {self.vocabulary(scene)}",
                 f"Agent skills: {skills}.",
                 what,
                 _RULES.format(hard_min=self.cfg.hard_min_triggers)]
        if avoid:
            parts.append("Already written (do not repeat): " + "; ".join(avoid))
        parts += [f"Reply JSON schema: {self._schema}",
                  f"Example reply (built by the procedural builder for this scene; one variant shown): "
                  f"{self.example(scene)}"]
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]

    # ------------------------------------------------------------------ building

    def build(self, seed: int, split: str, forbidden_texts: set[str] = frozenset(),
              forbidden_layouts: set[str] = frozenset(), difficulties=DIFFICULTIES, scene: str | None = None,
              instruction: str | None = None) -> list[TaskInstance]:
        sid = scene or self.scene_order[seed % len(self.scene_order)]
        if sid not in self.scenes:
            raise ValueError(f"LLMBuilder: unknown scene {sid!r}; this builder has {', '.join(self.scene_order)}")
        pack = self.scenes[sid]
        kind = random.Random(f"llm:{sid}:{seed}").choice(possible_kinds(pack))
        base = self.messages(pack, kind, tuple(difficulties), instruction)
        pending = list(difficulties)
        accepted: dict[str, TaskInstance] = {}
        solved: dict[str, bool] = {}
        last_reason: dict[str, str] = {}
        fixed = instruction   # once a variant is accepted, the others keep its instruction (and layout)
        layout_id: str | None = None
        messages = base
        for attempt in range(1, self.max_attempts + 1):
            if not pending:
                break
            rejected: dict[str, tuple[str, str]] = {}  # difficulty -> (reason code, feedback)
            try:
                reply = self.client.chat(messages, json_mode=True, seed=seed, max_tokens=self.max_tokens)
            except ModelError as e:
                reply = None
                rejected = {d: (f"model_error:{e.kind}", "") for d in pending}
            if reply is not None:
                parsed, problem = parse_reply(reply.text)
                if parsed is None:
                    rejected = {d: problem for d in pending}
                elif fixed is not None and parsed.instruction != fixed:
                    rejected = {d: ("instruction_changed", f"keep the instruction exactly: {fixed!r}")
                                for d in pending}
                elif parsed.instruction in forbidden_texts:
                    rejected = {d: ("instruction_in_other_split", "that instruction is used in the other split; "
                                    "write a different one") for d in pending}
                else:
                    lid = layout_id or layout_of(sid, parsed, pending)
                    if lid in forbidden_layouts:
                        rejected = {d: ("layout_in_other_split", "that layout is used in the other split; vary "
                                        "where things are and which connections exist") for d in pending}
                    else:
                        for d in pending:
                            task, reason, feedback, ok = self._variant(pack, parsed, d, split, seed, lid)
                            if task is None:
                                rejected[d] = (reason, feedback)
                                continue
                            accepted[d], solved[d] = task, ok
                            fixed, layout_id = parsed.instruction, lid
            for d, (reason, _) in rejected.items():
                self.attempt_reasons[reason] += 1
                self.attempts.append((sid, seed, d, attempt, reason))
                last_reason[d] = reason
            pending = [d for d in pending if d not in accepted]
            if pending and reply is not None:
                messages = base + [{"role": "assistant", "content": reply.text},
                                   {"role": "user", "content": self._feedback(rejected, pending, fixed)}]
        out = []
        for d in difficulties:
            if d in accepted:
                self.stats.accept(d, solved[d])
                out.append(accepted[d])
            else:
                self.stats.reject(d, last_reason.get(d, "rejected"))
        if out:
            self._written[sid].append(out[0].instruction)
        return out

    @staticmethod
    def _feedback(rejected: dict[str, tuple[str, str]], pending: list[str], fixed: str | None) -> str:
        lines = [f"- {d}: rejected ({code}){': ' + why if why else ''}" for d, (code, why) in rejected.items()]
        keep = f" Keep the instruction exactly: {fixed!r}." if fixed else ""
        return ("These variants were rejected:\n" + "\n".join(lines) +
                f"\nWrite the variants {', '.join(pending)} again, in the same reply format.{keep}")

    def _variant(self, scene: ScenePack, parsed: TaskReply, difficulty: str, split: str, seed: int,
                 layout_id: str) -> tuple[TaskInstance | None, str, str, bool]:
        """(instance, reason code, feedback, teacher solved): one variant through every check."""
        raw = parsed.variants.get(difficulty)
        if raw is None:
            return None, "missing_variant", f"the reply has no variants.{difficulty}", False
        try:
            variant = VariantReply.model_validate(raw)
            data = {"id": f"{scene.id}-{split}-llm{seed}-{difficulty}",
                    "instruction_id": _h({"scene": scene.id, "text": parsed.instruction}),
                    "instruction": parsed.instruction, "kind": parsed.kind, "difficulty": difficulty,
                    "scene": scene.id, "layout_id": layout_id, "split": split,
                    **variant.model_dump(mode="json"), "step_budget": 500, "optimal_steps": 1, "seed": seed}
            cand = TaskInstance.model_validate(data)
        except ValidationError as e:
            errs = e.errors()
            feedback = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in errs[:3])
            return None, "schema:" + str(errs[0]["loc"][:2]), feedback, False
        places = {p.id for p in scene.places}
        foreign = sorted(p.id for p in cand.env_state.places if p.id not in places)
        if foreign:
            return None, "unknown_scene_place", f"places {foreign} are not in scene {scene.id!r}", False
        count = trigger_count_problem(difficulty, len(cand.failure_triggers), self.cfg)
        if count:
            return None, "trigger_count", count, False
        refs = reference_problems(cand)
        if refs:
            return None, "bad_reference", "; ".join(refs[:5]), False
        try:
            final, reason, ok = validate_instance(cand, self.cfg)
        except Exception as e:  # an odd but schema-valid world (from the model) must be rejected, not end the build
            return None, f"validation_error:{type(e).__name__}", f"the variant could not be simulated ({e})", False
        if final is None:
            return None, reason, explain(reason, cand), False
        return final, "", "", ok


def variant_json(task: TaskInstance) -> dict:
    """A task's variant fields as the model writes them (None fields left out: the schema defaults them)."""
    return task.model_dump(mode="json", include=set(VARIANT_FIELDS), exclude_none=True)


def parse_reply(text: str) -> tuple[TaskReply | None, tuple[str, str]]:
    """The reply as a TaskReply, or (None, (reason code, feedback)). A ```json fence around it is allowed."""
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        return None, ("reply_not_json", f"the reply is not JSON ({e})")
    if not isinstance(data, dict):
        return None, ("reply_not_json", "the reply must be one JSON object")
    try:
        return TaskReply.model_validate(data), ("", "")
    except ValidationError as e:
        err = e.errors()[0]
        return None, ("schema:" + str(err["loc"][:2]), f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}")


def layout_of(scene_id: str, parsed: TaskReply, difficulties: list[str]) -> str:
    """The layout id of an instruction: from its easiest variant that parses (connections, item places,
    people, start), as the procedural builder hashes its sampled layout."""
    for d in difficulties:
        try:
            env = EnvState.model_validate(parsed.variants.get(d, {}).get("env_state"))
        except ValidationError:
            continue
        return _h({"scene": scene_id, "c": [c.id for c in env.connections],
                   "o": [(o.id, o.location, o.color) for o in env.objects],
                   "p": [(p.id, p.place) for p in env.people], "s": env.agent.place})
    return _h({"scene": scene_id, "instruction": parsed.instruction})
