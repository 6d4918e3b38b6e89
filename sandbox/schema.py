"""The sandbox's data model: every file and boundary is one of these strict pydantic models.

`extra="forbid"` rejects unknown keys; `strict=True` refuses silent coercions ("3" is not 3);
Literal fields (not Enums) keep strict mode usable from plain YAML/JSON dicts.
Errors name the field path (pydantic's `loc`), which the CLI turns into "file: field: message".
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)


Difficulty = Literal["easy", "medium", "hard"]
DIFFICULTIES: tuple[Difficulty, ...] = ("easy", "medium", "hard")
Split = Literal["train", "test", "rl"]   # rl: fresh instances for online RL (rl.task_pool: fresh)
Setting = Literal["indoor", "outdoor", "mixed"]
PlaceKind = Literal["room", "corridor", "outdoor", "stairwell"]
ConnectionKind = Literal["open", "door", "stairs", "path", "gate"]
DoorState = Literal["open", "closed", "locked"]
Size = Literal["small", "medium", "large"]

TriggerKind = Literal[
    "locked_door",          # physical: a door on the route is locked
    "blocked_path",         # physical: a connection is obstructed
    "object_moved",         # the map's last-known position is stale
    "device_malfunction",   # a device fails when operated
    "fragile_item",         # needs both hands free
    "too_heavy",            # cannot be lifted alone
    "restricted_area",      # entry needs permission
    "ambiguous_target",     # two objects match the instruction
    "person_knowledge",     # the target is somewhere only a person knows
    "person_busy",          # the helper refuses until asked again
]
TRIGGER_KINDS: tuple[str, ...] = TriggerKind.__args__  # type: ignore[attr-defined]

HelpRequest = Literal["unlock", "carry", "repair", "permission", "clear", "locate"]
HELP_REQUESTS: tuple[str, ...] = HelpRequest.__args__  # type: ignore[attr-defined]

InstructionKind = Literal[
    "navigation", "object_search", "state_inspection", "fetch_place", "ask_person", "operate", "multi_stage"
]


# ----------------------------------------------------------------------------- world


class Place(Strict):
    id: str
    name: str
    kind: PlaceKind = "room"
    floor: int = 0
    restricted: bool = False   # entry refused until someone grants permission
    hidden: bool = False       # not on the agent's map until a person reveals it


class Connection(Strict):
    id: str
    a: str
    b: str
    kind: ConnectionKind = "open"
    door: DoorState | None = None  # only for kind "door" or "gate"
    color: str | None = None       # BabyAI-style coloured doors
    blocked: bool = False
    hidden: bool = False

    @model_validator(mode="after")
    def _door_state(self) -> "Connection":
        if self.kind in ("door", "gate") and self.door is None:
            raise ValueError(f"connection {self.id!r}: a {self.kind} needs a door state (open, closed or locked)")
        if self.kind not in ("door", "gate") and self.door is not None:
            raise ValueError(f"connection {self.id!r}: only doors and gates have a door state")
        return self


class SceneObject(Strict):
    id: str
    type: str
    name: str
    color: str | None = None
    size: Size = "small"
    location: str                 # a place id, or the id of a container/surface object
    portable: bool = True
    heavy: bool = False
    fragile: bool = False
    container: bool = False       # things can be put inside (if open) or on (if surface)
    surface: bool = False
    openable: bool = False
    open: bool = False
    locked: bool = False
    opens: str | None = None      # for keys: the connection or container this key unlocks
    device: bool = False
    on: bool = False
    broken: bool = False
    owner: str | None = None      # revealed by inspection (name tag)
    next_to: str | None = None
    details: dict[str, str] = Field(default_factory=dict)  # what inspection tells beyond state


class AgentState(Strict):
    place: str
    holding: list[str] = Field(default_factory=list)
    capacity: int = Field(default=2, ge=1, le=4)


class Person(Strict):
    id: str
    name: str
    role: str
    place: str


class AssistanceRule(Strict):
    """What a person does for one kind of request, and under which conditions."""

    request: HelpRequest
    requires_reason: bool = False   # refuses unless the request states a reason
    once: bool = False              # helps at most once with this request
    requires_nearby: bool = True    # only answers someone in the same place


class HumanPersona(Strict):
    person: str                                  # Person.id
    role: str
    style: Literal["friendly", "terse", "formal"] = "friendly"
    capabilities: list[HelpRequest] = Field(default_factory=list)
    knowledge: dict[str, str] = Field(default_factory=dict)  # topic (entity id or fact id) -> answer text
    reveals: dict[str, list[str]] = Field(default_factory=dict)  # topic -> hidden entity ids it puts on the map
    policy: list[AssistanceRule] = Field(default_factory=list)
    busy_until_asked: int = Field(default=0, ge=0, le=3)  # refuses this many requests first


class Fact(Strict):
    id: str
    question: str    # how the instruction phrases it ("when visiting hours end")
    answer: str      # the value a correct report contains


class EnvState(Strict):
    places: list[Place]
    connections: list[Connection]
    objects: list[SceneObject]
    agent: AgentState
    people: list[Person] = Field(default_factory=list)
    facts: list[Fact] = Field(default_factory=list)
    locks_visible: bool = False   # BabyAI: a locked door looks locked

    @model_validator(mode="after")
    def _references(self) -> "EnvState":
        place_ids = [p.id for p in self.places]
        obj_ids = [o.id for o in self.objects]
        conn_ids = [c.id for c in self.connections]
        person_ids = [p.id for p in self.people]
        all_ids = place_ids + obj_ids + conn_ids + person_ids + [f.id for f in self.facts]
        dup = sorted({i for i in all_ids if all_ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate ids: {dup}")
        places, objs, conns = set(place_ids), set(obj_ids), set(conn_ids)
        for c in self.connections:
            for end in (c.a, c.b):
                if end not in places:
                    raise ValueError(f"connections[{c.id}]: unknown place {end!r}")
        for o in self.objects:
            if o.location not in places and o.location not in objs:
                raise ValueError(f"objects[{o.id}].location: unknown place or container {o.location!r}")
            if o.opens is not None and o.opens not in conns and o.opens not in objs:
                raise ValueError(f"objects[{o.id}].opens: unknown door or container {o.opens!r}")
            if o.next_to is not None and o.next_to not in objs:
                raise ValueError(f"objects[{o.id}].next_to: unknown object {o.next_to!r}")
        by_id = {o.id: o for o in self.objects}
        for o in self.objects:  # containment must be acyclic and end at a place
            seen, loc = {o.id}, o.location
            while loc in by_id:
                if loc in seen:
                    raise ValueError(f"objects[{o.id}].location: containment cycle through {loc!r}")
                seen.add(loc)
                loc = by_id[loc].location
        if self.agent.place not in places:
            raise ValueError(f"agent.place: unknown place {self.agent.place!r}")
        for h in self.agent.holding:
            if h not in objs:
                raise ValueError(f"agent.holding: unknown object {h!r}")
        for p in self.people:
            if p.place not in places:
                raise ValueError(f"people[{p.id}].place: unknown place {p.place!r}")
        return self


# ----------------------------------------------------------------------------- triggers


class FailureTrigger(Strict):
    """One obstacle: when it fires (condition), what happens (effect), how to get past it (recovery).

    The physical facts live in env_state (a locked door, a heavy object); the trigger names them so the
    controller can report which obstacle fired, the validator can prove it matters, and the judge can
    check that recovery followed. None of this reaches the agent.
    """

    id: str
    kind: TriggerKind
    target: str                                # the entity it concerns (door, object, place, person, device)
    skills: list[str]                          # the skills whose use can fire it
    condition: str
    effect: str
    recovery: list[str]
    candidates: list[str] = Field(default_factory=list)  # ambiguous_target: the look-alikes


# ----------------------------------------------------------------------------- goals and success


class ObjectRef(Strict):
    """How an instruction names an object: by type, and optionally colour and owner."""

    type: str
    color: str | None = None
    owner: str | None = None   # a Person.id
    id: str | None = None      # when the instruction names a landmark that is on the agent's map


class GoalStep(Strict):
    """The public, structured reading of the instruction (what it says, nothing hidden)."""

    op: Literal["go_to", "find_report", "inspect_report", "fetch", "operate", "open_door", "ask_report"]
    object: ObjectRef | None = None
    place: str | None = None          # go_to / fetch destination place
    container: str | None = None      # fetch destination fixture/container id
    next_to: ObjectRef | None = None  # fetch: put next to another object
    attribute: Literal["on", "open", "locked", "broken"] | None = None
    action: Literal["turn_on", "turn_off"] | None = None
    door: str | None = None
    person: str | None = None
    fact: str | None = None


class _Pred(Strict):
    pass


class AgentAt(_Pred):
    kind: Literal["agent_at"] = "agent_at"
    place: str


class AgentNear(_Pred):
    kind: Literal["agent_near"] = "agent_near"
    object: str


class Holding(_Pred):
    kind: Literal["holding"] = "holding"
    object: str


class ObjectAt(_Pred):
    kind: Literal["object_at"] = "object_at"
    object: str
    location: str   # place id (anywhere in it, not held) or container/surface id (exactly there)


class NextTo(_Pred):
    kind: Literal["next_to"] = "next_to"
    object: str
    other: str


class ObjectStateIs(_Pred):
    kind: Literal["object_state"] = "object_state"
    object: str
    field: Literal["open", "on", "locked", "broken"]
    value: bool


class DoorOpen(_Pred):
    kind: Literal["door_open"] = "door_open"
    door: str


class Observed(_Pred):
    kind: Literal["observed"] = "observed"
    object: str


class Inspected(_Pred):
    kind: Literal["inspected"] = "inspected"
    object: str


class Told(_Pred):
    kind: Literal["told"] = "told"
    fact: str


class Reported(_Pred):
    kind: Literal["reported"] = "reported"
    value: str
    aliases: list[str] = Field(default_factory=list)
    excludes: list[str] = Field(default_factory=list)   # words that make a report wrong (the opposite state)


Predicate = Annotated[
    Union[AgentAt, AgentNear, Holding, ObjectAt, NextTo, ObjectStateIs, DoorOpen, Observed, Inspected, Told,
          Reported],
    Field(discriminator="kind"),
]


class Subgoal(Strict):
    id: str
    description: str
    predicate: Predicate


# ----------------------------------------------------------------------------- what the agent may see


class MapPlace(Strict):
    id: str
    name: str
    kind: PlaceKind
    floor: int
    landmarks: list[str] = Field(default_factory=list)  # fixture ids visible as landmarks


class MapConnection(Strict):
    id: str
    a: str
    b: str
    kind: ConnectionKind
    door: DoorState | None = None  # as last seen (a locked door looks closed unless locks are visible)
    color: str | None = None


class MapObject(Strict):
    id: str
    name: str
    type: str
    color: str | None = None
    last_seen: str | None = None   # a place or container id; may be stale


class MapPerson(Strict):
    id: str
    name: str
    role: str
    last_seen: str


class AgentView(Strict):
    """The filtered semantic map the agent starts with. Never trigger details or hidden positions."""

    places: list[MapPlace]
    connections: list[MapConnection]
    objects: list[MapObject]
    people: list[MapPerson]


# ----------------------------------------------------------------------------- task instance


class TaskInstance(Strict):
    id: str
    instruction_id: str
    instruction: str
    kind: InstructionKind
    difficulty: Difficulty
    scene: str
    layout_id: str
    split: Split
    env_state: EnvState
    failure_triggers: list[FailureTrigger] = Field(default_factory=list)
    human_persona: list[HumanPersona] = Field(default_factory=list)
    goal: list[GoalStep]
    subgoals: list[Subgoal]
    success: list[Predicate]
    agent_view: AgentView
    step_budget: int = Field(ge=1, le=500)
    optimal_steps: int = Field(ge=1)
    seed: int

    @model_validator(mode="after")
    def _consistent(self) -> "TaskInstance":
        st = self.env_state
        ids = ({p.id for p in st.places} | {o.id for o in st.objects} | {c.id for c in st.connections}
               | {p.id for p in st.people} | {f.id for f in st.facts})
        for t in self.failure_triggers:
            if t.target not in ids:
                raise ValueError(f"failure_triggers[{t.id}].target: unknown entity {t.target!r}")
        people = {p.id for p in st.people}
        for h in self.human_persona:
            if h.person not in people:
                raise ValueError(f"human_persona[{h.person}].person: unknown person")
        if self.optimal_steps > self.step_budget:
            raise ValueError(f"optimal_steps {self.optimal_steps} exceeds step_budget {self.step_budget}")
        if not self.subgoals:
            raise ValueError("subgoals: at least one subgoal is required")
        return self

    @property
    def fingerprint(self) -> list:
        """What a cached evaluation of this task depends on (`rl.trainer`'s initial evaluation)."""
        return [self.id, self.instruction, self.step_budget]


# ----------------------------------------------------------------------------- scene packs (data files)


class ScenePlace(Strict):
    id: str
    name: str
    kind: PlaceKind = "room"
    floor: int = 0
    can_restrict: bool = False   # the builder may make it a restricted area
    hidden_spot: bool = False    # a back room the builder may hide from the map


class SceneConnection(Strict):
    a: str
    b: str
    kind: ConnectionKind = "open"
    color: str | None = None
    lockable: bool = False       # the builder may lock it (with a key somewhere, or a person to unlock)
    blockable: bool = False      # the builder may block it
    optional: bool = False       # present in some layouts only


class SceneFixture(Strict):
    """Furniture, containers and devices: fixed landmarks of a place."""

    id: str
    type: str
    name: str
    place: str
    container: bool = False
    surface: bool = False
    openable: bool = False
    device: bool = False
    details: dict[str, str] = Field(default_factory=dict)


class SceneItem(Strict):
    """A portable object kind; the builder places instances of it."""

    type: str
    name: str
    colors: list[str] = Field(default_factory=list)
    size: Size = "small"
    spawn: list[str]             # place or fixture ids where it may appear
    can_be_heavy: bool = False
    can_be_fragile: bool = False
    owned: bool = False          # may carry a name tag (ambiguous-target tasks)


class ScenePerson(Strict):
    id: str
    name: str
    role: str
    places: list[str]
    capabilities: list[HelpRequest] = Field(default_factory=list)
    style: Literal["friendly", "terse", "formal"] = "friendly"


class SceneFact(Strict):
    id: str
    question: str
    answers: list[str]
    holders: list[str]           # person ids who know it


class ScenePack(Strict):
    id: str
    name: str
    setting: Setting
    description: str
    vocabulary: Literal["default", "babyai"] = "default"
    locks_visible: bool = False
    places: list[ScenePlace]
    connections: list[SceneConnection]
    fixtures: list[SceneFixture] = Field(default_factory=list)
    items: list[SceneItem]
    people: list[ScenePerson] = Field(default_factory=list)
    facts: list[SceneFact] = Field(default_factory=list)
    start_places: list[str]

    @model_validator(mode="after")
    def _references(self) -> "ScenePack":
        places = {p.id for p in self.places}
        fixtures = {f.id for f in self.fixtures}
        for i, c in enumerate(self.connections):
            for end in (c.a, c.b):
                if end not in places:
                    raise ValueError(f"connections[{i}]: unknown place {end!r}")
        for f in self.fixtures:
            if f.place not in places:
                raise ValueError(f"fixtures[{f.id}].place: unknown place {f.place!r}")
        for it in self.items:
            for s in it.spawn:
                if s not in places and s not in fixtures:
                    raise ValueError(f"items[{it.type}].spawn: unknown place or fixture {s!r}")
        people = {p.id for p in self.people}
        for p in self.people:
            for pl in p.places:
                if pl not in places:
                    raise ValueError(f"people[{p.id}].places: unknown place {pl!r}")
        for f in self.facts:
            for h in f.holders:
                if h not in people:
                    raise ValueError(f"facts[{f.id}].holders: unknown person {h!r}")
        for s in self.start_places:
            if s not in places:
                raise ValueError(f"start_places: unknown place {s!r}")
        return self


# ----------------------------------------------------------------------------- step results

ErrorCode = Literal[
    "parse_error",          # the model output held no readable tool call (agent.parser)
    "unknown_tool",
    "bad_arguments",        # arguments are not a JSON object
    "missing_argument",
    "extra_argument",
    "bad_argument_type",
    "bad_argument_value",
    "unknown_entity",       # no such id that the agent knows of (never says whether it exists)
    "unreachable",          # no known route
    "precondition_unmet",   # e.g. not here, hands full, already open, not holding it
    "trigger_fired",        # an obstacle of the task stopped the action
    "refused",              # a person declined (busy, no reason given, cannot help)
    "episode_over",
]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__  # type: ignore[attr-defined]
# Codes that mean the action itself was invalid (the invalid-action rate); obstacles and refusals are not.
INVALID_CODES = frozenset(ERROR_CODES) - {"trigger_fired", "refused"}
