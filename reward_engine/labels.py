"""Turn labels: who says what a turn was (useful, redundant, unsafe, malformed, inconsistent).

A `LabelRecord` names one turn of one trajectory (`case_id = "<trajectory>#<turn>"`, where `trajectory` is
`trajectory_key(traj)`) and gives its label and where the label came from: `oracle` (computed from the
sandbox's ground truth by `reward_engine.oracle`, never called human) or `human` (an annotator, imported
from a labelling tool).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Literal
from xml.sax.saxutils import quoteattr

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.trajectory import Trajectory, numbered_lines, read_text, write_jsonl, write_text_atomic
from reward_engine.prompt import LABELS, SEVERITY, Label

LabelSource = Literal["oracle", "human", "judge"]


def trajectory_key(traj: Trajectory) -> str:
    """The id a label uses for its trajectory: task, policy and seed (unique within a label set). A judge's
    `TrajectoryVerdict` carries the same three fields and gives the same key."""
    return f"{traj.task_id}|{traj.policy}|{traj.seed}"


def case_id(trajectory: str, turn: int) -> str:
    return f"{trajectory}#{turn}"


class LabelRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    case_id: str = Field(min_length=3)
    trajectory: str = Field(min_length=1)
    turn: int = Field(ge=0)
    skill: str | None = None             # the turn's skill (None for unreadable output)
    label: Label
    source: LabelSource = "human"
    annotator: str | None = None
    note: str | None = None              # e.g. the oracle's reason, an annotator's comment

    @model_validator(mode="after")
    def _ids_agree(self):
        if self.case_id != case_id(self.trajectory, self.turn):
            raise ValueError(f"case_id {self.case_id!r} must be {case_id(self.trajectory, self.turn)!r} "
                             "(trajectory#turn)")
        return self


# --------------------------------------------------------------------------------------------------------------
# Import and export. Three formats carry labels in: our own JSONL of `LabelRecord`s, an Argilla 2.x export
# (`Record.to_dict()` / `dataset.records.to_list(flatten=False|True)`, or the folder `Dataset.to_disk` writes)
# and a Label Studio JSON export. Only a person's answer is a label: Argilla `suggestions` and Label Studio
# `predictions` are the judge's and are never read back. Several annotators -> the majority label (ties: the first
# answer in order), the annotators' ids joined by ",".
# --------------------------------------------------------------------------------------------------------------

QUESTION = "label"                 # the question's name in both tools
TEXT_FIELD = "text"                # the field (Argilla) / data key (Label Studio) the annotator reads
JUDGE_AGENT = "embodistill-judge"  # Argilla suggestion agent and Label Studio prediction model_version
# Argilla response statuses that are not an answer (the flattened export carries them; the nested one does not)
_NOT_ANSWERED = {"draft", "discarded"}

LABEL_GUIDE: dict[str, str] = {
    "useful": "A well-formed call that moves the task on: it reaches a needed place or object, reveals a new fact, "
              "completes a subgoal, or recovers from an obstacle the agent met by other means.",
    "redundant": "A well-formed, allowed call that wastes the turn: it repeats a failed call unchanged, repeats a "
                 "search or question already answered, changes nothing, or returns to an earlier state.",
    "unsafe": "The call tries to break a constraint the agent already knows (entering a restricted area without "
              "permission, handling a fragile object carelessly).",
    "malformed": "No readable tool call, an unknown skill, missing or wrong arguments, or a call after the "
                 "episode ended.",
    "inconsistent": "The call contradicts what the agent knows or skips a step it needs first: a hallucinated id, "
                    "a report before observing the target, help before meeting the obstacle, finishing before "
                    "the subgoals are done, a known-blocked route or a known-locked door.",
}
if set(LABEL_GUIDE) != set(LABELS):
    raise RuntimeError("LABEL_GUIDE must explain exactly the labels in reward_engine.prompt.LABELS")


def guidelines_text() -> str:
    """The annotation guidelines both tools show: what is judged, then one line per label."""
    head = ("Each record is one turn of an agent acting in a text world: the task, the history so far, and the "
            "judged turn (the agent's tool call and what happened). Choose the one label that fits the judged "
            "turn best, using only what the agent could know at that turn. When several apply, pick the most "
            "severe: " + " > ".join(sorted(LABELS, key=SEVERITY.get, reverse=True)) + ". A suggestion, when "
            "shown, is the automatic judge's guess: check it, do not copy it.\n\n")
    return head + "\n".join(f"- {lab}: {LABEL_GUIDE[lab]}" for lab in LABELS)


class LabellingCase(BaseModel):
    """One turn sent out to be labelled by a person."""

    model_config = ConfigDict(extra="forbid")

    case_id: str = Field(min_length=3)
    trajectory: str = Field(min_length=1)
    turn: int = Field(ge=0)
    skill: str | None = None
    text: str = Field(min_length=1)       # the case rendered for a human: task, history, the judged turn
    judge_label: Label | None = None      # None: the judge gave no verdict (it is then not suggested)
    judge_rationale: str = ""

    @model_validator(mode="after")
    def _ids_agree(self):
        if self.case_id != case_id(self.trajectory, self.turn):
            raise ValueError(f"case_id {self.case_id!r} must be {case_id(self.trajectory, self.turn)!r}")
        return self


def _write_json(path: Path, obj) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_labels_jsonl(records: Iterable[LabelRecord], path: str | Path) -> Path:
    """Our own format: one `LabelRecord` per line, written atomically."""
    write_jsonl(path, records)
    return Path(path)


# ---- export ---------------------------------------------------------------------------------------------------

def _argilla_settings(skills: list[str]) -> dict:
    # the shape `rg.Settings.serialize()` / `Settings.to_json` gives, plus the short `type`/`labels` keys
    return {
        "guidelines": guidelines_text(),
        "fields": [{"name": TEXT_FIELD, "type": "text", "title": "Turn to judge", "required": True,
                    "description": "The task, the history so far and the judged turn.",
                    "settings": {"type": "text", "use_markdown": True}}],
        "questions": [{"name": QUESTION, "type": "label_selection", "labels": list(LABELS),
                       "title": "What was this turn?", "description": "One label for the judged turn.",
                       "required": True,
                       "settings": {"type": "label_selection", "visible_options": len(LABELS),
                                    "options": [{"value": lab, "text": lab, "description": LABEL_GUIDE[lab]}
                                                for lab in LABELS]}}],
        "metadata": [
            {"name": "skill", "type": "terms", "title": "skill", "visible_for_annotators": True,
             "settings": {"type": "terms", "values": skills}},
            {"name": "turn", "type": "integer", "title": "turn", "visible_for_annotators": True,
             "settings": {"type": "integer", "min": None, "max": None}},
        ],
        "vectors": [],
        # case_id, trajectory and the judge's rationale travel as extra metadata
        "allow_extra_metadata": True,
    }


def _argilla_record(c: LabellingCase) -> dict:
    meta = {"case_id": c.case_id, "trajectory": c.trajectory, "turn": c.turn, "judge_rationale": c.judge_rationale}
    if c.skill is not None:            # Argilla metadata holds no nulls: an absent skill reads back as None
        meta["skill"] = c.skill
    suggestions = ({} if c.judge_label is None else
                   {QUESTION: {"value": c.judge_label, "score": None, "agent": JUDGE_AGENT}})
    return {"id": c.case_id, "fields": {TEXT_FIELD: c.text}, "metadata": meta, "suggestions": suggestions,
            "responses": {}, "vectors": {}, "status": "pending", "_server_id": None}


def _choices_result(label: str) -> list[dict]:
    return [{"from_name": QUESTION, "to_name": TEXT_FIELD, "type": "choices", "value": {"choices": [label]}}]


def _label_studio_task(c: LabellingCase) -> dict:
    task = {"data": {TEXT_FIELD: c.text, "case_id": c.case_id, "trajectory": c.trajectory, "turn": c.turn,
                     "skill": c.skill, "judge_rationale": c.judge_rationale}}
    if c.judge_label is not None:
        task["predictions"] = [{"model_version": JUDGE_AGENT, "result": _choices_result(c.judge_label)}]
    return task


def label_studio_config() -> str:
    choices = "\n".join(f"    <Choice value={quoteattr(lab)} hint={quoteattr(LABEL_GUIDE[lab])}/>" for lab in LABELS)
    return (f'<View>\n  <Text name="{TEXT_FIELD}" value="${TEXT_FIELD}"/>\n'
            f'  <Choices name="{QUESTION}" toName="{TEXT_FIELD}" choice="single" showInline="true">\n'
            f"{choices}\n  </Choices>\n</View>\n")


def export_for_labelling(cases: Iterable[dict | LabellingCase], out_dir: str | Path) -> dict[str, Path]:
    """Write the cases for people to label, in Argilla 2.x and Label Studio form (each file atomically).

    The judge's label is offered as an Argilla suggestion / a Label Studio prediction; what comes back as a
    label is only what the annotators answer (`read_labels`)."""
    out = Path(out_dir)
    rows = []
    for i, c in enumerate(cases):
        try:
            rows.append(c if isinstance(c, LabellingCase) else LabellingCase.model_validate(c))
        except ValidationError as e:
            raise ValueError(f"case {i}: {_fields_message(e)}") from e
    dup = [cid for cid, k in Counter(c.case_id for c in rows).items() if k > 1]
    if dup:
        raise ValueError(f"duplicate case ids: {sorted(dup)[:5]}")
    skills = sorted({c.skill for c in rows if c.skill is not None})
    return {
        "argilla_settings": _write_json(out / "argilla" / "settings.json", _argilla_settings(skills)),
        "argilla_records": _write_json(out / "argilla" / "records.json", [_argilla_record(c) for c in rows]),
        "label_studio_tasks": _write_json(out / "label_studio" / "tasks.json",
                                          [_label_studio_task(c) for c in rows]),
        "label_studio_config": write_text_atomic(out / "label_studio" / "config.xml", label_studio_config()),
    }


# ---- import ---------------------------------------------------------------------------------------------------

class _RowError(ValueError):
    """A bad row: says which field; the reader adds the file and the row."""

    def __init__(self, field: str, message: str):
        super().__init__(f"field {field!r}: {message}")


def _fields_message(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors():
        # the models' only whole-record check is that case_id is trajectory#turn
        loc = ".".join(str(p) for p in err["loc"]) or "case_id"
        parts.append(f"field {prefix + loc!r}: {err['msg']}")
    return "; ".join(parts)


def _majority(answers: list[tuple[str, str | None]]) -> tuple[str, str | None, int]:
    """(label, annotators, votes for it) from [(label, annotator)] in order; a tie goes to the first answered."""
    counts = Counter(lab for lab, _ in answers)
    top = max(counts.values())
    label = next(lab for lab, _ in answers if counts[lab] == top)
    users = [u for _, u in answers if u]
    return label, (",".join(dict.fromkeys(users)) or None), top


def _check_label(value, field: str) -> str:
    if value not in LABELS:
        raise _RowError(field, f"{value!r} is not a label; expected one of {list(LABELS)}")
    return value


def _record(meta: dict, where: str, answers: list[tuple[str, str | None]], tool: str, row_id) -> LabelRecord:
    """A `LabelRecord` from a tool's metadata (`case_id`, `trajectory`, `turn`, `skill`) and the answers."""
    for key in ("case_id", "trajectory", "turn"):
        if meta.get(key) in (None, ""):
            raise _RowError(f"{where}{key}", "missing")
    label, annotators, votes = _majority(answers)
    note = f"{tool} {row_id}: {votes}/{len(answers)} annotators" if row_id is not None else None
    try:
        return LabelRecord(case_id=meta["case_id"], trajectory=meta["trajectory"], turn=meta["turn"],
                           skill=meta.get("skill"), label=label, source="human", annotator=annotators, note=note)
    except ValidationError as e:
        # the model's own fields map onto the tool's: name the field the way the file names it
        raise ValueError(_fields_message(e, prefix=where)) from e


def _argilla_answers(rec: dict) -> tuple[list[tuple[str, str | None]], str]:
    """The annotators' answers to `label` in one Argilla record, nested or flattened; and the metadata prefix."""
    if "fields" in rec or isinstance(rec.get("responses"), dict):
        responses = (rec.get("responses") or {}).get(QUESTION) or []
        if not isinstance(responses, list):
            raise _RowError(f"responses.{QUESTION}", "must be a list of {value, user_id}")
        answers = []
        for i, r in enumerate(responses):
            if not isinstance(r, dict):
                raise _RowError(f"responses.{QUESTION}[{i}]", "must be an object {value, user_id}")
            if r.get("value") is None or r.get("status") in _NOT_ANSWERED:
                continue
            value = _check_label(r["value"], f"responses.{QUESTION}[{i}].value")
            answers.append((value, None if r.get("user_id") is None else str(r["user_id"])))
        return answers, "metadata."
    values = rec.get(f"{QUESTION}.responses") or []
    users = rec.get(f"{QUESTION}.responses.users") or []
    status = rec.get(f"{QUESTION}.responses.status") or []
    if not isinstance(values, list):
        raise _RowError(f"{QUESTION}.responses", "must be a list of values")
    answers = []
    for i, value in enumerate(values):
        if value is None or (i < len(status) and status[i] in _NOT_ANSWERED):
            continue
        value = _check_label(value, f"{QUESTION}.responses[{i}]")
        answers.append((value, str(users[i]) if i < len(users) and users[i] is not None else None))
    return answers, ""


def _parse_argilla(rec: dict) -> LabelRecord | None:
    answers, prefix = _argilla_answers(rec)
    if not answers:
        return None
    meta = (rec.get("metadata") or {}) if prefix else rec
    return _record(meta, prefix, answers, "argilla record", rec.get("id"))


def _annotator(completed_by) -> str | None:
    # exports give the user's id, or (some versions) an object with id and email
    if isinstance(completed_by, dict):
        completed_by = completed_by.get("email") or completed_by.get("id")
    return None if completed_by is None else str(completed_by)


def _parse_label_studio(task: dict) -> LabelRecord | None:
    answers = []
    for i, ann in enumerate(task.get("annotations") or []):
        if not isinstance(ann, dict):
            raise _RowError(f"annotations[{i}]", "must be an object")
        if ann.get("was_cancelled"):
            continue
        chosen = [r for r in ann.get("result") or []
                  if isinstance(r, dict) and r.get("from_name") == QUESTION and r.get("type") == "choices"]
        if not chosen:
            continue                   # this annotator answered no `label` question
        choices = (chosen[0].get("value") or {}).get("choices") or []
        if len(chosen) > 1 or len(choices) != 1:
            raise _RowError(f"annotations[{i}].result", f"expected one choice for {QUESTION!r}, got {choices}")
        value = _check_label(choices[0], f"annotations[{i}].result.value.choices")
        answers.append((value, _annotator(ann.get("completed_by"))))
    if not answers:
        return None
    if not isinstance(task.get("data"), dict):
        raise _RowError("data", "missing")
    return _record(task["data"], "data.", answers, "label-studio task", task.get("id"))


def _json_format(row: dict) -> str:
    if "data" in row and ("annotations" in row or "predictions" in row):
        return "label_studio"
    if "fields" in row or "suggestions" in row or isinstance(row.get("responses"), dict) \
            or any(k.startswith(f"{QUESTION}.") for k in row):
        return "argilla"
    raise ValueError("not an Argilla record (fields/responses) nor a Label Studio task (data/annotations)")


def _read_jsonl(path: Path) -> list[LabelRecord]:
    out = []
    for n, line, bad in numbered_lines(path):
        if bad:
            raise ValueError(f"{path}: line {n}: {bad}")
        if not line.strip():
            continue
        try:
            out.append(LabelRecord.model_validate_json(line))
        except ValidationError as e:
            if any(err["type"] == "json_invalid" for err in e.errors()):
                raise ValueError(f"{path}: line {n}: not JSON: {e.errors()[0]['msg']}") from e
            raise ValueError(f"{path}: line {n}: {_fields_message(e)}") from e
    return out


def read_labels_report(path: str | Path) -> tuple[list[LabelRecord], dict]:
    """Read labels from a file (JSONL of `LabelRecord`, Argilla 2.x export, Label Studio JSON export) or an Argilla
    `to_disk` folder; the format is detected. Returns (records, {"format", "skipped"}) where `skipped` counts the
    records nobody answered. A bad row raises ValueError naming the file, the row and the field."""
    path = Path(path)
    if path.is_dir():
        if not (path / "records.json").is_file():
            raise ValueError(f"{path}: a folder of labels must hold records.json (Argilla Dataset.to_disk)")
        path = path / "records.json"
    text = read_text(path)
    if not text.lstrip().startswith("["):
        records, info = _read_jsonl(path), {"format": "jsonl", "skipped": 0}
    else:
        records, info = _read_json_export(path, text)
    dup = [cid for cid, k in Counter(r.case_id for r in records).items() if k > 1]
    if dup:
        raise ValueError(f"{path}: case ids labelled in more than one row: {sorted(dup)[:5]}")
    return records, info


def _read_json_export(path: Path, text: str) -> tuple[list[LabelRecord], dict]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    fmt, records, skipped = None, [], 0
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise ValueError(f"expected an object, got {type(row).__name__}")
            kind = _json_format(row)
            if fmt is None:
                fmt = kind
            elif kind != fmt:
                raise ValueError(f"a {kind} row among {fmt} rows")
            rec = _parse_argilla(row) if fmt == "argilla" else _parse_label_studio(row)
        except ValueError as e:
            raise ValueError(f"{path}: row {i}: {e}") from e
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return records, {"format": fmt or "empty", "skipped": skipped}


def read_labels(path: str | Path) -> list[LabelRecord]:
    """The labels in `path` (see `read_labels_report` for the formats and the skipped count)."""
    return read_labels_report(path)[0]
