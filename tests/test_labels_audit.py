"""Turn labels in and out (JSONL, Argilla 2.x, Label Studio) and the agreement audit (kappa, bootstrap, McNemar,
report files)."""

from __future__ import annotations

import copy
import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from evaluation.pixel_report import wilson
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



# ---- the libraries give the figures of the hand-written formulas they replaced ---------------------------------
# The references below are the project's own formulas as they were before sklearn, scipy and statsmodels took
# over (copied, not imported): on the shipped oracle labels every library-backed figure must match them to 1e-9.

TOL = 1e-9


def _ref_kappa_from_counts(counts):
    counts = np.asarray(counts).astype(np.float64)
    n = counts.sum(axis=(-2, -1))
    p_o = np.trace(counts, axis1=-2, axis2=-1) / n
    p_e = (counts.sum(axis=-1) * counts.sum(axis=-2)).sum(axis=-1) / n**2
    degenerate = p_e >= 1.0 - 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        kappa = (p_o - p_e) / (1.0 - p_e)
    return np.where(degenerate, np.where(p_o >= 1.0 - 1e-12, 1.0, 0.0), kappa)


def _ref_cells(y_true, y_pred):
    index = {lab: i for i, lab in enumerate(LABELS)}
    return np.array([index[a] * len(LABELS) + index[b] for a, b in zip(y_true, y_pred, strict=True)])


def _ref_kappa(y_true, y_pred):
    k = len(LABELS)
    return float(_ref_kappa_from_counts(np.bincount(_ref_cells(y_true, y_pred), minlength=k * k).reshape(k, k)))


def _ref_bootstrap(y_true, y_pred, n=1000, seed=0, alpha=0.05):
    k, m = len(LABELS), len(y_true)
    cells = _ref_cells(y_true, y_pred)
    rng = np.random.default_rng(seed)
    kappas = np.empty(n)
    chunk = max(1, 2_000_000 // m)
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        idx = rng.integers(0, m, size=(b, m))
        flat = cells[idx] + (np.arange(b) * k * k)[:, None]
        counts = np.bincount(flat.ravel(), minlength=b * k * k).reshape(b, k, k)
        kappas[start:start + b] = _ref_kappa_from_counts(counts)
    lo, hi = np.quantile(kappas, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def _ref_mcnemar(correct_a, correct_b, exact_max=5000):
    """(b01, b10, statistic, p): the exact binomial test up to exact_max discordant pairs, else chi-square."""
    b01 = sum(bool(a) and not bool(b) for a, b in zip(correct_a, correct_b, strict=True))
    b10 = sum(bool(b) and not bool(a) for a, b in zip(correct_a, correct_b, strict=True))
    m = b01 + b10
    if m <= exact_max:
        tail = sum(math.comb(m, i) for i in range(min(b01, b10) + 1))
        return b01, b10, min(b01, b10), min(1.0, 2 * tail / 2**m)
    chi2 = (abs(b01 - b10) - 1) ** 2 / m
    return b01, b10, chi2, math.erfc(math.sqrt(chi2 / 2))


def _ref_wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


@pytest.fixture(scope="module")
def shipped_judged():
    """The shipped oracle labels and the rule judge's verdicts under the default and the draft prompt."""
    from reward_engine.judge import RewardEngine, RuleBackend
    from reward_engine.labels import trajectory_key
    from reward_engine.oracle import read_oracle_set
    from reward_engine.prompt import default_prompt, draft_prompt
    trajs, records = read_oracle_set()

    def judged(prompt):
        eng = RewardEngine(prompt, RuleBackend())
        return {case_id(trajectory_key(tr), v.index): {"label": v.label, "prompt_version": prompt.version}
                for tr in trajs for v in eng.score(tr).turns}
    return records, judged(default_prompt()), judged(draft_prompt())


def test_library_statistics_match_the_formulas_they_replaced_on_the_shipped_labels(shipped_judged):
    records, ja, jb = shipped_judged
    rep = audit_report(records, ja, jb, n_boot=1000, seed=0)
    y = [r.label for r in records]
    ya, yb = [ja[r.case_id]["label"] for r in records], [jb[r.case_id]["label"] for r in records]
    assert rep["n"] == rep["compare"]["n"] == len(y) > 2000 and rep["missing"] == rep["judge_errors"] == 0
    worst = dict.fromkeys(("kappa", "ci", "mcnemar", "wilson"), 0.0)

    def close(name, got, want):
        assert got == pytest.approx(want, abs=TOL, rel=0), name
        worst[name] = max(worst[name], abs(got - want))

    # kappa and its bootstrap interval: the report's headline and both compared versions, each skill, subsets
    close("kappa", rep["kappa"], _ref_kappa(y, ya))
    close("kappa", rep["compare"]["b"]["kappa"], _ref_kappa(y, yb))
    for got, want in zip(rep["kappa_ci"], _ref_bootstrap(y, ya), strict=True):
        close("ci", got, want)
    for got, want in zip(rep["compare"]["b"]["kappa_ci"], _ref_bootstrap(y, yb), strict=True):
        close("ci", got, want)
    skills = [r.skill for r in records]
    groups = {s: [i for i, v in enumerate(skills) if v == s] for s in set(skills)}
    rng = np.random.default_rng(0)
    subsets = [*groups.values(), *(sorted(rng.choice(len(y), size=int(rng.integers(2, 300)), replace=False))
                                   for _ in range(6))]
    for idx in subsets:
        t, a, b = [y[i] for i in idx], [ya[i] for i in idx], [yb[i] for i in idx]
        for p in (a, b):
            close("kappa", cohen_kappa(t, p), _ref_kappa(t, p))
        for seed, n, alpha in ((0, 1000, 0.05), (3, 401, 0.01), (7, 777, 0.1)):
            for got, want in zip(bootstrap_kappa(t, a, n=n, seed=seed, alpha=alpha),
                                 _ref_bootstrap(t, a, n=n, seed=seed, alpha=alpha), strict=True):
                close("ci", got, want)

    # McNemar: the report's test, per skill (exact) and, tiled past EXACT_MAX discordant pairs, chi-square
    ca, cb = [t == p for t, p in zip(y, ya, strict=True)], [t == p for t, p in zip(y, yb, strict=True)]
    cases = [(ca, cb), *(([ca[i] for i in idx], [cb[i] for i in idx]) for idx in groups.values()),
             (cb * 4, (cb[1:] + cb[:1]) * 4), (ca * 60, (ca[7:] + ca[:7]) * 60)]
    tests = set()
    for i, (a, b) in enumerate(cases):
        res = rep["compare"]["mcnemar"] if i == 0 else mcnemar(a, b)
        b01, b10, stat, p = _ref_mcnemar(a, b)
        assert (res["b01"], res["b10"]) == (b01, b10)
        close("mcnemar", res["statistic"], stat)
        close("mcnemar", res["p_value"], p)
        tests.add(res["test"])
    assert tests == {"exact binomial", "chi-square, continuity corrected"}
    assert any(1e-6 < mcnemar(a, b)["p_value"] < 1 for a, b in cases)    # not only underflowed or capped p-values

    # Wilson: agreement as a proportion, overall and per skill, for both prompts; then every k of small n
    for correct in (ca, cb):
        for idx in (range(len(y)), *groups.values()):
            k, n = sum(correct[i] for i in idx), len(idx)
            for got, want in zip(wilson(k, n), _ref_wilson(k, n), strict=True):
                close("wilson", got, want)
    for n in range(41):
        for k in range(n + 1):
            for z in (1.0, 1.96, 2.5758):
                for got, want in zip(wilson(k, n, z), _ref_wilson(k, n, z), strict=True):
                    close("wilson", got, want)
    print("max abs difference from the replaced formulas:", worst)


def test_statistics_come_from_the_libraries(monkeypatch):
    import scipy.stats
    import sklearn.metrics
    import statsmodels.stats.contingency_tables
    import statsmodels.stats.proportion
    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapped)

    spy(sklearn.metrics, "cohen_kappa_score")
    spy(scipy.stats, "bootstrap")
    spy(statsmodels.stats.contingency_tables, "mcnemar")
    spy(statsmodels.stats.proportion, "proportion_confint")
    t, p = [U, U, R, R, M], [U, R, R, R, M]
    cohen_kappa(t, p)
    bootstrap_kappa(t, p, n=20)
    mcnemar([True, False, True], [False, False, True])
    mcnemar([True] * 3000 + [False] * 3200, [False] * 3000 + [True] * 3200)
    wilson(3, 10)
    assert calls == ["cohen_kappa_score", "bootstrap", "mcnemar", "mcnemar", "proportion_confint"]


def test_statistics_bad_input_stays_clear():
    with pytest.raises(ValueError, match="no pairs to compare"):
        cohen_kappa([], [])
    with pytest.raises(ValueError, match="no pairs to compare"):
        bootstrap_kappa([], [])
    with pytest.raises(ValueError, match="unknown label 'great'"):
        bootstrap_kappa([U, "great"], [U, U])
    with pytest.raises(ValueError, match="n >= 1"):
        bootstrap_kappa([U, R], [U, R], n=0)
    with pytest.raises(ValueError, match="differ in length"):
        mcnemar([True], [True, False])
    assert mcnemar([], [])["p_value"] == 1.0
    for t, p in (([U], [R]), ([U], [U])):                # one pair: every resample is that pair
        assert bootstrap_kappa(t, p) == _ref_bootstrap(t, p) == (cohen_kappa(t, p), cohen_kappa(t, p))
        assert cohen_kappa(t, p) == _ref_kappa(t, p)
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, 7)[0] == 0.0 and wilson(7, 7)[1] == 1.0
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson(11, 10)

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
