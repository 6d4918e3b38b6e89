"""Turn labels in and out (JSONL, Argilla 2.x, Label Studio) and the agreement audit (kappa, bootstrap, McNemar,
report files)."""

from __future__ import annotations

import copy
import json
import math
import xml.etree.ElementTree as ET

import pytest

from reward_engine.audit import (agreement, audit_report, bootstrap_kappa, cohen_kappa, confusion, mcnemar,
                                 per_skill_table, write_audit)
from reward_engine.labels import (JUDGE_AGENT, LabelRecord, case_id, export_for_labelling, read_labels,
                                  read_labels_report, write_labels_jsonl)
from reward_engine.prompt import LABELS

U, R, S, M, INC = "useful", "redundant", "unsafe", "malformed", "inconsistent"


# ---- statistics -----------------------------------------------------------------------------------------------

def test_kappa_hand_computed():
    # po = 3/4; rows (2, 2), columns (1, 3): pe = (2*1 + 2*3) / 16 = 1/2; kappa = (3/4 - 1/2) / (1/2) = 1/2
    assert cohen_kappa([U, U, R, R], [U, R, R, R]) == pytest.approx(0.5)
    # 50 items: yes/yes 20, yes/no 5, no/yes 10, no/no 15: po = 0.7, pe = (25*30 + 25*20) / 2500 = 0.5, kappa = 0.4
    t = [U] * 25 + [R] * 25
    p = [U] * 20 + [R] * 5 + [U] * 10 + [R] * 15
    assert agreement(t, p) == pytest.approx(0.7)
    assert cohen_kappa(t, p) == pytest.approx(0.4)
    assert cohen_kappa([U, R, M, S, INC], [U, R, M, S, INC]) == pytest.approx(1.0)


def test_kappa_low_despite_high_agreement_under_class_imbalance():
    # 18 useful + 2 redundant; the judge calls one useful turn redundant and both redundant turns useful.
    # po = 17/20 = 0.85; rows (18, 2), columns (19, 1): pe = (18*19 + 2*1) / 400 = 0.86; kappa = -0.01/0.14
    t = [U] * 18 + [R] * 2
    p = [U] * 17 + [R] + [U] * 2
    assert agreement(t, p) == pytest.approx(0.85)
    assert cohen_kappa(t, p) == pytest.approx(-1 / 14)


def test_kappa_degenerate_and_bad_input():
    assert cohen_kappa([U] * 5, [U] * 5) == 1.0          # expected agreement 1, observed 1
    with pytest.raises(ValueError, match="unknown label 'great'"):
        cohen_kappa([U, "great"], [U, U])
    with pytest.raises(ValueError, match="length"):
        agreement([U], [U, R])


def test_confusion_rows_are_reference_columns_are_judge():
    m = confusion([U, U, R], [R, U, R])
    assert m[LABELS.index(U)][LABELS.index(R)] == 1      # reference useful, judge redundant
    assert m[LABELS.index(R)][LABELS.index(U)] == 0
    assert m[LABELS.index(U)][LABELS.index(U)] == 1 and m[LABELS.index(R)][LABELS.index(R)] == 1
    assert sum(map(sum, m)) == 3 and len(m) == len(LABELS)


def test_bootstrap_interval_contains_estimate_and_is_seeded():
    t = [U] * 25 + [R] * 25
    p = [U] * 20 + [R] * 5 + [U] * 10 + [R] * 15
    lo, hi = bootstrap_kappa(t, p, n=500, seed=3)
    assert lo < cohen_kappa(t, p) < hi and -1 <= lo < hi <= 1
    assert (lo, hi) == bootstrap_kappa(t, p, n=500, seed=3)
    assert (lo, hi) != bootstrap_kappa(t, p, n=500, seed=4)
    wide = bootstrap_kappa(t, p, n=500, seed=3, alpha=0.01)
    assert wide[0] <= lo and wide[1] >= hi
    assert bootstrap_kappa([U] * 8, [U] * 8, n=50) == (1.0, 1.0)


def test_mcnemar_exact_and_large():
    # b01 = 0, b10 = 6: p = 2 * C(6, 0) / 2^6 = 0.03125
    res = mcnemar([False] * 6 + [True] * 4, [True] * 6 + [True] * 4)
    assert (res["b01"], res["b10"], res["n"]) == (0, 6, 10)
    assert res["p_value"] == pytest.approx(0.03125) and res["test"] == "exact binomial"
    # b01 = 2, b10 = 1: p = 2 * (C(3,0) + C(3,1)) / 8 = 1.0
    assert mcnemar([True, True, False], [False, False, True])["p_value"] == pytest.approx(1.0)
    assert mcnemar([True, False], [True, False])["p_value"] == 1.0           # no discordant pairs
    big = mcnemar([True] * 3000 + [False] * 3200, [False] * 3000 + [True] * 3200)
    assert big["test"].startswith("chi-square")
    assert big["p_value"] == pytest.approx(math.erfc(math.sqrt((200 - 1) ** 2 / 6200 / 2)))
    assert 0 < big["p_value"] < 0.05


def test_per_skill_table():
    table = per_skill_table(["navigate", None, "navigate", "report", "navigate"],
                            [U, M, R, U, U], [U, M, U, R, U])
    assert list(table) == ["navigate", "report", "(malformed)"]
    assert table["navigate"]["n"] == 3 and table["navigate"]["agreement"] == pytest.approx(2 / 3)
    assert table["(malformed)"] == {"n": 1, "agreement": 1.0, "kappa": 1.0}
    assert table["report"]["agreement"] == 0.0


# ---- the audit ------------------------------------------------------------------------------------------------

def _rec(traj, turn, label, skill="navigate", source="oracle"):
    return LabelRecord(case_id=case_id(traj, turn), trajectory=traj, turn=turn, skill=skill, label=label,
                       source=source, note="oracle reason" if source == "oracle" else None)


def _judged(label, version=1):
    return {"label": label, "rationale": f"because {label}", "prompt_version": version, "prompt_hash": f"h{version}"}


def _audit_inputs():
    records = [_rec("t|p|0", 0, U), _rec("t|p|0", 1, R), _rec("t|p|0", 2, U, skill="report"),
               _rec("t|p|0", 3, M, skill=None), _rec("t|p|1", 0, U), _rec("t|p|1", 1, S)]
    judged = {"t|p|0#0": _judged(U), "t|p|0#1": _judged(U), "t|p|0#2": _judged(U), "t|p|0#3": _judged(M),
              "t|p|1#1": _judged(None)}          # t|p|1#0 missing; t|p|1#1 a judge error (its label was unsafe)
    judged_b = {k: _judged(v["label"], 2) for k, v in judged.items()} | {"t|p|0#1": _judged(R, 2)}
    return records, judged, judged_b


def test_audit_report_counts_missing_and_judge_errors_outside_the_statistics():
    records, judged, judged_b = _audit_inputs()
    rep = audit_report(records, judged, examples=5)
    assert (rep["n"], rep["missing"], rep["judge_errors"], rep["n_labels"]) == (4, 1, 1, 6)
    assert rep["agreement"] == pytest.approx(3 / 4)               # not 3/5 or 4/6
    assert rep["kappa"] == pytest.approx(cohen_kappa([U, R, U, M], [U, U, U, M]))
    lo, hi = rep["kappa_ci"]
    assert lo <= rep["kappa"] <= hi
    assert rep["label_sources"] == {"oracle": 6} and rep["source"] == "oracle"
    assert rep["confusion"]["matrix"][LABELS.index(R)][LABELS.index(U)] == 1
    assert sum(map(sum, rep["confusion"]["matrix"])) == 4
    assert rep["per_skill"]["(malformed)"]["n"] == 1 and rep["per_skill"]["navigate"]["n"] == 2
    assert rep["disagreements"] == [{"case_id": "t|p|0#1", "skill": "navigate", "label": R, "judge_label": U,
                                     "judge_rationale": "because useful", "label_source": "oracle",
                                     "label_note": "oracle reason"}]
    assert rep["prompt"] == [{"version": 1, "hash": "h1"}]
    assert "compare" not in rep
    json.dumps(rep)                                                 # JSON-able

    rep = audit_report(records, judged, judged_b)
    c = rep["compare"]
    assert c["n"] == 4 and c["a"]["agreement"] == pytest.approx(0.75) and c["b"]["agreement"] == 1.0
    assert (c["mcnemar"]["b01"], c["mcnemar"]["b10"]) == (0, 1)
    assert c["b"]["missing"] == 1 and c["b"]["judge_errors"] == 1
    assert c["per_skill"]["navigate"] == {"n": 2, "agreement_a": 0.5, "agreement_b": 1.0}

    with pytest.raises(ValueError, match="more than once"):
        audit_report(records + records[:1], judged)
    with pytest.raises(ValueError, match="judged"):
        audit_report(records, {"t|p|0#0": {"label": "great"}})


def test_audit_report_with_nothing_judged():
    rep = audit_report([_rec("t|p|0", 0, U, source="human")], {"t|p|0#0": _judged(None)})
    assert rep["n"] == 0 and rep["agreement"] is None and rep["kappa"] is None and rep["judge_errors"] == 1


def test_write_audit_files(tmp_path):
    records, judged, judged_b = _audit_inputs()
    paths = write_audit(audit_report(records, judged, judged_b), tmp_path / "audit", "Judge vs oracle")
    rep = json.loads(paths["json"].read_text())
    assert rep["n"] == 4 and rep["compare"]["mcnemar"]["test"] == "exact binomial"
    for key in ("confusion", "per_skill"):
        data = paths[key].read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert md.startswith("# Judge vs oracle")
    assert "oracle labels" in md and "not human labels" in md
    assert "| navigate | 2 |" in md and "McNemar" in md and "t|p|0#1" in md
    assert not [p for p in (tmp_path / "audit").iterdir() if p.name.startswith(".")]    # no temp files left

    human = audit_report([_rec("t|p|0", 0, U, source="human")], {"t|p|0#0": _judged(R)})
    md = write_audit(human, tmp_path / "human", "Judge vs people")["markdown"].read_text()
    assert "oracle" not in md and "source human" in md


# ---- labels in and out ----------------------------------------------------------------------------------------

def _cases():
    return [
        {"case_id": "kitchen|expert|0#0", "trajectory": "kitchen|expert|0", "turn": 0, "skill": "navigate",
         "text": "Task: find the mug.\nTurn 0: navigate(kitchen) -> you are in the kitchen.",
         "judge_label": U, "judge_rationale": "moves towards the target"},
        {"case_id": "kitchen|expert|0#1", "trajectory": "kitchen|expert|0", "turn": 1, "skill": "navigate",
         "text": "Turn 1: navigate(kitchen) -> you are already here.", "judge_label": U, "judge_rationale": "ok"},
        {"case_id": "kitchen|expert|0#2", "trajectory": "kitchen|expert|0", "turn": 2, "skill": None,
         "text": "Turn 2: <garbled>", "judge_label": None, "judge_rationale": ""},
        {"case_id": "lab|student|3#0", "trajectory": "lab|student|3", "turn": 0, "skill": "report",
         "text": "Turn 0: report(mug in lab)", "judge_label": INC, "judge_rationale": "reported before seeing"},
    ]


ANSWERS = {"kitchen|expert|0#0": U, "kitchen|expert|0#1": R, "kitchen|expert|0#2": M, "lab|student|3#0": INC}


def _check_round_trip(records, cases=None):
    cases = cases or _cases()
    assert [r.case_id for r in records] == [c["case_id"] for c in cases]
    for r, c in zip(records, cases, strict=True):
        assert (r.trajectory, r.turn, r.skill, r.label, r.source) == (c["trajectory"], c["turn"], c["skill"],
                                                                     ANSWERS[c["case_id"]], "human")


def test_export_files(tmp_path):
    paths = export_for_labelling(_cases(), tmp_path)
    settings = json.loads(paths["argilla_settings"].read_text())
    q = settings["questions"][0]
    assert q["name"] == "label" and q["type"] == "label_selection" and q["labels"] == list(LABELS)
    assert settings["fields"][0]["name"] == "text" and settings["fields"][0]["type"] == "text"
    skill_meta = next(m for m in settings["metadata"] if m["name"] == "skill")
    assert skill_meta["type"] == "terms" and skill_meta["settings"]["values"] == ["navigate", "report"]
    assert all(lab in settings["guidelines"] for lab in LABELS)

    records = json.loads(paths["argilla_records"].read_text())
    assert records[0]["suggestions"]["label"] == {"value": U, "score": None, "agent": JUDGE_AGENT}
    assert records[2]["suggestions"] == {} and records[0]["responses"] == {}
    assert records[0]["fields"]["text"].startswith("Task: find the mug")
    assert records[3]["metadata"] == {"case_id": "lab|student|3#0", "trajectory": "lab|student|3", "turn": 0,
                                      "skill": "report", "judge_rationale": "reported before seeing"}

    tasks = json.loads(paths["label_studio_tasks"].read_text())
    assert tasks[0]["predictions"][0]["model_version"] == JUDGE_AGENT
    assert tasks[0]["predictions"][0]["result"][0]["value"] == {"choices": [U]}
    assert "predictions" not in tasks[2] and tasks[2]["data"]["skill"] is None
    root = ET.fromstring(paths["label_studio_config"].read_text())
    choices = root.find("Choices")
    assert root.find("Text").get("value") == "$text" and choices.get("name") == "label"
    assert choices.get("toName") == "text" and choices.get("choice") == "single"
    assert [c.get("value") for c in choices.findall("Choice")] == list(LABELS)
    assert not [p for p in tmp_path.rglob(".*")]                    # atomic: no temp files left

    bad = _cases()
    bad[1]["case_id"] = "kitchen|expert|0#9"
    with pytest.raises(ValueError, match="case 1"):
        export_for_labelling(bad, tmp_path / "bad")


def _answered_argilla(tmp_path):
    paths = export_for_labelling(_cases(), tmp_path)
    records = json.loads(paths["argilla_records"].read_text())
    for r in records:
        r["responses"] = {"label": [{"value": ANSWERS[r["id"]], "user_id": "u1"}]}
    return records


def test_argilla_round_trip_nested_and_folder(tmp_path):
    records = _answered_argilla(tmp_path)
    # an unanswered record whose judge suggestion must not become a label
    records.append({"id": "x", "fields": {"text": "t"}, "metadata": {"case_id": "x|y|0#0", "trajectory": "x|y|0",
                    "turn": 0}, "suggestions": {"label": {"value": U, "score": 0.9, "agent": JUDGE_AGENT}},
                    "responses": {}, "vectors": {}, "status": "pending"})
    # a response without a value (discarded) is no answer
    records[1]["responses"]["label"].insert(0, {"value": None, "user_id": "u9"})
    path = tmp_path / "export.json"
    path.write_text(json.dumps(records))
    got, info = read_labels_report(path)
    _check_round_trip(got)
    assert info == {"format": "argilla", "skipped": 1}
    assert all(r.annotator == "u1" for r in got)

    folder = tmp_path / "to_disk"                                   # what rg.Dataset.to_disk writes
    folder.mkdir()
    (folder / "settings.json").write_text((tmp_path / "argilla" / "settings.json").read_text())
    (folder / "records.json").write_text(json.dumps(records))
    _check_round_trip(read_labels(folder))
    with pytest.raises(ValueError, match="records.json"):
        read_labels(tmp_path / "label_studio")


def _flatten(rec: dict) -> dict:
    """One record the way `dataset.records.to_list(flatten=True)` gives it."""
    flat = {"id": rec["id"], "_server_id": None, "status": rec["status"], **rec["fields"], **rec["metadata"]}
    answers = rec["responses"].get("label", [])
    if answers:
        flat["label.responses"] = [a["value"] for a in answers]
        flat["label.responses.users"] = [a["user_id"] for a in answers]
        flat["label.responses.status"] = [a.get("status", "submitted") for a in answers]
    sug = rec["suggestions"].get("label")
    if sug:
        flat |= {"label.suggestion": sug["value"], "label.suggestion.score": sug["score"],
                 "label.suggestion.agent": sug["agent"]}
    return flat


def test_argilla_round_trip_flattened(tmp_path):
    records = _answered_argilla(tmp_path)
    # a draft by a second annotator does not count (counted, it would win the tie by coming first)
    records[1]["responses"]["label"].insert(0, {"value": U, "user_id": "u2", "status": "draft"})
    flat = [_flatten(r) for r in records]
    keys = set().union(*flat)                                       # to_list fills absent keys with None
    flat = [{k: f.get(k) for k in keys} for f in flat]
    flat[2]["label.responses"] = flat[2]["label.responses.users"] = flat[2]["label.responses.status"] = None
    path = tmp_path / "flat.json"
    path.write_text(json.dumps(flat))
    got, info = read_labels_report(path)
    assert info == {"format": "argilla", "skipped": 1}
    cases = [c for c in _cases() if c["case_id"] != "kitchen|expert|0#2"]
    _check_round_trip(got, cases)
    assert got[1].annotator == "u1"


def _answered_label_studio(tmp_path):
    paths = export_for_labelling(_cases(), tmp_path)
    tasks = json.loads(paths["label_studio_tasks"].read_text())
    for i, t in enumerate(tasks, 1):
        t["id"] = i
        t["annotations"] = [{"result": [{"from_name": "label", "to_name": "text", "type": "choices",
                                         "value": {"choices": [ANSWERS[t["data"]["case_id"]]]}}],
                             "completed_by": 1, "was_cancelled": False}]
    return tasks


def test_label_studio_round_trip(tmp_path):
    tasks = _answered_label_studio(tmp_path)
    # a cancelled annotation does not vote; predictions are never labels; an unannotated task is skipped
    tasks[1]["annotations"].append({"result": [], "completed_by": 2, "was_cancelled": True})
    tasks[1]["annotations"].append({"result": [{"from_name": "label", "to_name": "text", "type": "choices",
                                                "value": {"choices": [U]}}], "completed_by": 3,
                                    "was_cancelled": True})
    tasks.append({"id": 99, "data": {"text": "x", "case_id": "x|y|0#0", "trajectory": "x|y|0", "turn": 0},
                  "annotations": [], "predictions": [{"model_version": JUDGE_AGENT, "result": []}]})
    path = tmp_path / "ls_export.json"
    path.write_text(json.dumps(tasks))
    got, info = read_labels_report(path)
    _check_round_trip(got)
    assert info == {"format": "label_studio", "skipped": 1}
    assert got[1].annotator == "1"


def test_majority_vote_over_annotators(tmp_path):
    tasks = _answered_label_studio(tmp_path)
    vote = [(R, 7), (U, {"id": 8, "email": "b@x.org"}), (R, 9)]
    tasks[0]["annotations"] = [{"result": [{"from_name": "label", "to_name": "text", "type": "choices",
                                            "value": {"choices": [lab]}}], "completed_by": who}
                               for lab, who in vote]
    tasks[3]["annotations"] = tasks[3]["annotations"][:1] + [
        {"result": [{"from_name": "label", "to_name": "text", "type": "choices", "value": {"choices": [U]}}],
         "completed_by": 5}]                                       # a tie: the first answer (inconsistent) wins
    path = tmp_path / "votes.json"
    path.write_text(json.dumps(tasks))
    got = {r.case_id: r for r in read_labels(path)}
    assert got["kitchen|expert|0#0"].label == R and got["kitchen|expert|0#0"].annotator == "7,b@x.org,9"
    assert got["lab|student|3#0"].label == INC and got["lab|student|3#0"].annotator == "1,5"

    records = _answered_argilla(tmp_path / "a")
    records[0]["responses"]["label"] = [{"value": S, "user_id": "a"}, {"value": U, "user_id": "b"},
                                        {"value": U, "user_id": "c"}]
    path = tmp_path / "votes_argilla.json"
    path.write_text(json.dumps(records))
    first = read_labels(path)[0]
    assert first.label == U and first.annotator == "a,b,c" and "2/3" in first.note


def test_jsonl_round_trip(tmp_path):
    recs = [_rec("t|p|0", 0, U), _rec("t|p|0", 1, R, skill=None, source="human")]
    path = write_labels_jsonl(recs, tmp_path / "labels.jsonl")
    got, info = read_labels_report(path)
    assert got == recs and info == {"format": "jsonl", "skipped": 0}


def test_bad_rows_name_file_row_and_field(tmp_path):
    good = _rec("t|p|0", 0, U).model_dump_json()
    path = tmp_path / "labels.jsonl"
    path.write_text(good + "\n" + good.replace('"useful"', '"great"') + "\n")
    with pytest.raises(ValueError, match=r"labels\.jsonl: line 2: field 'label'"):
        read_labels(path)
    path.write_text(good + "\n" + json.dumps({k: v for k, v in json.loads(good).items() if k != "case_id"}))
    with pytest.raises(ValueError, match=r"labels\.jsonl: line 2: field 'case_id'"):
        read_labels(path)
    path.write_text(good + "\n" + good)
    with pytest.raises(ValueError, match="more than one row"):
        read_labels(path)

    records = _answered_argilla(tmp_path)
    records[1]["responses"]["label"][0]["value"] = "great"
    path = tmp_path / "argilla.json"
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"argilla\.json: row 1: field 'responses\.label\[0\]\.value': 'great'"):
        read_labels(path)

    records = _answered_argilla(tmp_path)
    del records[2]["metadata"]["case_id"]
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"argilla\.json: row 2: field 'metadata\.case_id': missing"):
        read_labels(path)

    flat = [_flatten(r) for r in _answered_argilla(tmp_path)]
    flat[3]["turn"] = 5                                              # case id no longer trajectory#turn
    path.write_text(json.dumps(flat))
    with pytest.raises(ValueError, match=r"row 3: field 'case_id'"):
        read_labels(path)

    tasks = _answered_label_studio(tmp_path)
    del tasks[0]["data"]["case_id"]
    path = tmp_path / "ls.json"
    path.write_text(json.dumps(tasks))
    with pytest.raises(ValueError, match=r"ls\.json: row 0: field 'data\.case_id': missing"):
        read_labels(path)

    tasks = _answered_label_studio(tmp_path)
    tasks[1]["annotations"][0]["result"][0]["value"]["choices"] = ["Useful"]
    path.write_text(json.dumps(tasks))
    with pytest.raises(ValueError, match=r"row 1: field 'annotations\[0\]\.result\.value\.choices'"):
        read_labels(path)

    path.write_text(json.dumps([{"foo": 1}]))
    with pytest.raises(ValueError, match="row 0: not an Argilla record"):
        read_labels(path)
    mixed = copy.deepcopy(_answered_argilla(tmp_path)[:1]) + _answered_label_studio(tmp_path)[:1]
    path.write_text(json.dumps(mixed))
    with pytest.raises(ValueError, match="row 1: a label_studio row among argilla rows"):
        read_labels(path)
