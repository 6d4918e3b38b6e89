"""Agreement audits: how often the judge gives the label a person (or the sandbox oracle) gave.

Pure functions over parallel lists of labels (strings from `reward_engine.prompt.LABELS`), then `audit_report`,
which joins `LabelRecord`s with the judge's verdicts, and `write_audit`, which writes the report as JSON, Markdown
and two PNG charts.

Statistics, with y = the reference label (human or oracle) and ŷ = the judge's, n paired turns, K labels and C the
K×K confusion matrix (rows y, columns ŷ). The library that computes each is named in brackets; the libraries are
imported inside the functions that use them (together they cost about 1.2 s to import, which commands that never
compute a statistic should not pay).

    agreement   p_o = Σ_k C_kk / n
    Cohen's κ   κ = (p_o − p_e) / (1 − p_e),  p_e = Σ_k r_k c_k / n²   (r, c: row and column sums; Cohen 1960)
                [sklearn.metrics.cohen_kappa_score over the fixed label set]; when p_e = 1 (both raters used one
                same label throughout, so p_o = 1 too) κ is undefined and we return 1
    bootstrap   resample the n pairs with replacement B times, κ on each, the percentile interval
                [q_{α/2}, q_{1−α/2}] (Efron & Tibshirani 1993, ch. 13)  [scipy.stats.bootstrap, method="percentile",
                with a seeded numpy Generator; κ of each resample comes from one batched `bincount`]
    McNemar     two prompt versions on the same turns: b01 = A right and B wrong, b10 = A wrong and B right;
                under H0 b01 ~ Binomial(b01 + b10, 1/2): exact two-sided p = min(1, 2 Σ_{i≤min(b01,b10)} C(m,i) / 2^m)
                for m = b01 + b10 ≤ EXACT_MAX; above that, χ² = (|b01 − b10| − 1)² / m with one degree of freedom
                (McNemar 1947, with Edwards' continuity correction)
                [statsmodels.stats.contingency_tables.mcnemar, exact=True / exact=False, correction=True]
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent.trajectory import atomic_target, write_text_atomic
from reward_engine.labels import LabelRecord
from reward_engine.prompt import LABELS, Label

MALFORMED_SKILL = "(malformed)"   # the per-skill row for turns without a readable skill
EXACT_MAX = 5000                  # largest discordant count for the exact McNemar test


# ---- statistics -----------------------------------------------------------------------------------------------

def _check_pair(y_true: Sequence, y_pred: Sequence) -> None:
    if len(y_true) != len(y_pred):
        raise ValueError(f"y_true and y_pred differ in length: {len(y_true)} != {len(y_pred)}")
    if len(y_true) == 0:
        raise ValueError("no pairs to compare")


def _encode(y: Sequence[str], labels: Sequence[str]) -> np.ndarray:
    index = {lab: i for i, lab in enumerate(labels)}
    try:
        return np.fromiter((index[v] for v in y), dtype=np.int64, count=len(y))
    except KeyError as e:
        raise ValueError(f"unknown label {e.args[0]!r}; expected one of {list(labels)}") from None


def _kappa_of_cells(cells: np.ndarray, k: int, axis: int = -1) -> np.ndarray:
    """κ of each row of (B, n) pairs, each pair coded as its confusion cell y·K + ŷ; vectorized for
    `scipy.stats.bootstrap`: one `bincount` gives every row's confusion matrix. The same formula as
    `cohen_kappa_score`, which would take a Python call per resample (about 1.5 ms each for n = 3000, so 1.5 s per
    1000-resample interval instead of a few tens of ms)."""
    if axis not in (-1, cells.ndim - 1) or cells.ndim != 2:
        raise ValueError("κ is taken over the last axis of a (B, n) array")
    b = cells.shape[0]
    flat = cells + (np.arange(b) * k * k)[:, None]            # offset each resample into its own K×K block
    counts = np.bincount(flat.ravel(), minlength=b * k * k).reshape(b, k, k).astype(np.float64)
    m = counts.sum(axis=(-2, -1))
    p_o = np.trace(counts, axis1=-2, axis2=-1) / m
    p_e = (counts.sum(axis=-1) * counts.sum(axis=-2)).sum(axis=-1) / m**2
    degenerate = p_e >= 1.0 - 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        kappa = (p_o - p_e) / (1.0 - p_e)
    return np.where(degenerate, np.where(p_o >= 1.0 - 1e-12, 1.0, 0.0), kappa)


def agreement(y_true: Sequence[str], y_pred: Sequence[str]) -> float:
    """The share of pairs with the same label."""
    _check_pair(y_true, y_pred)
    return sum(a == b for a, b in zip(y_true, y_pred, strict=True)) / len(y_true)


def confusion(y_true: Sequence[str], y_pred: Sequence[str], labels: Sequence[str] = LABELS) -> list[list[int]]:
    """Counts C[i][j] of pairs with reference label labels[i] (rows: human/oracle) and judge label labels[j]."""
    _check_pair(y_true, y_pred)
    k = len(labels)
    cells = _encode(y_true, labels) * k + _encode(y_pred, labels)
    return np.bincount(cells, minlength=k * k).reshape(k, k).tolist()


def cohen_kappa(y_true: Sequence[str], y_pred: Sequence[str], labels: Sequence[str] = LABELS) -> float:
    """Cohen's κ (see the module docstring) by `sklearn.metrics.cohen_kappa_score` over the fixed label set;
    1.0 when the expected agreement is 1 (both raters gave one same label to every pair)."""
    _check_pair(y_true, y_pred)
    t, p = _encode(y_true, labels), _encode(y_pred, labels)     # unknown labels fail here, by name
    if t.min() == t.max() == p.min() == p.max():
        return 1.0                 # p_e = p_o = 1: κ is 0/0 (sklearn would warn and return its replacement)
    from sklearn.metrics import cohen_kappa_score
    return float(cohen_kappa_score(t, p, labels=np.arange(len(labels))))


def bootstrap_kappa(y_true: Sequence[str], y_pred: Sequence[str], n: int = 1000, seed: int = 0,
                    alpha: float = 0.05, labels: Sequence[str] = LABELS) -> tuple[float, float]:
    """Percentile bootstrap interval (1 − alpha) for κ by `scipy.stats.bootstrap`: `n` resamples of the pairs,
    drawn by `np.random.default_rng(seed)` in batches that bound memory (about 16 MB of indices at a time)."""
    _check_pair(y_true, y_pred)
    if n < 1 or not 0.0 < alpha < 1.0:
        raise ValueError("bootstrap needs n >= 1 and 0 < alpha < 1")
    k, m = len(labels), len(y_true)
    cells = _encode(y_true, labels) * k + _encode(y_pred, labels)     # one sample of pairs, each its cell
    if m == 1:                     # scipy wants two pairs; every resample of one pair is that pair
        kappa = cohen_kappa(y_true, y_pred, labels)
        return (kappa, kappa)
    from scipy.stats import bootstrap
    res = bootstrap((cells,), partial(_kappa_of_cells, k=k), n_resamples=n, batch=max(1, 2_000_000 // m),
                    vectorized=True, confidence_level=1 - alpha, method="percentile",
                    rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mcnemar(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> dict:
    """McNemar's test for two judges (prompt versions A and B) scored on the same turns (see the module docstring),
    by statsmodels: the exact binomial test for up to EXACT_MAX discordant pairs, else the continuity-corrected
    chi-square test. Returns {n, b01 (A right, B wrong), b10 (A wrong, B right), statistic (min(b01, b10) for
    the exact test, χ² for the chi-square one), p_value, test}."""
    if len(correct_a) != len(correct_b):
        raise ValueError(f"correct_a and correct_b differ in length: {len(correct_a)} != {len(correct_b)}")
    a = np.fromiter((bool(x) for x in correct_a), dtype=bool, count=len(correct_a))
    b = np.fromiter((bool(x) for x in correct_b), dtype=bool, count=len(correct_b))
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]])   # rows A, columns B
    b01, b10 = int(table[0, 1]), int(table[1, 0])
    exact = b01 + b10 <= EXACT_MAX
    from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar
    res = sm_mcnemar(table, exact=exact, correction=True)
    return {"n": len(correct_a), "b01": b01, "b10": b10, "statistic": float(res.statistic),
            "p_value": float(res.pvalue), "test": "exact binomial" if exact else "chi-square, continuity corrected"}


def _skill_name(skill: str | None) -> str:
    return MALFORMED_SKILL if skill is None else skill


def per_skill_table(skills: Sequence[str | None], y_true: Sequence[str], y_pred: Sequence[str]) -> dict[str, dict]:
    """{skill: {n, agreement, kappa}} for each skill (None -> "(malformed)"), skills sorted, "(malformed)" last."""
    _check_pair(y_true, y_pred)
    if len(skills) != len(y_true):
        raise ValueError(f"skills and labels differ in length: {len(skills)} != {len(y_true)}")
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(skills):
        groups.setdefault(_skill_name(s), []).append(i)
    table = {}
    for name in sorted(groups, key=lambda s: (s == MALFORMED_SKILL, s)):
        t = [y_true[i] for i in groups[name]]
        p = [y_pred[i] for i in groups[name]]
        table[name] = {"n": len(t), "agreement": agreement(t, p), "kappa": cohen_kappa(t, p)}
    return table


# ---- the audit ------------------------------------------------------------------------------------------------

class JudgedTurn(BaseModel):
    """The judge's verdict on one labelled turn (extra keys such as the score are allowed and ignored)."""

    model_config = ConfigDict(extra="ignore")

    label: Label | None = None           # None: the judge gave no verdict (a judge error)
    rationale: str = ""
    prompt_version: int | None = None
    prompt_hash: str | None = None


def _judged(judged: Mapping[str, Mapping | JudgedTurn], name: str) -> dict[str, JudgedTurn]:
    out = {}
    for cid, v in judged.items():
        try:
            out[cid] = v if isinstance(v, JudgedTurn) else JudgedTurn.model_validate(v)
        except ValueError as e:
            raise ValueError(f"{name}[{cid!r}]: {e}") from e
    return out


def _prompts(turns: Iterable[JudgedTurn]) -> list[dict]:
    seen = dict.fromkeys((t.prompt_version, t.prompt_hash) for t in turns)
    return [{"version": v, "hash": h} for v, h in seen]


def _pairs(records: Sequence[LabelRecord], judged: dict[str, JudgedTurn]):
    """(records with a judge label, missing, judge_errors)."""
    kept, missing, errors = [], 0, 0
    for r in records:
        j = judged.get(r.case_id)
        if j is None:
            missing += 1
        elif j.label is None:
            errors += 1
        else:
            kept.append(r)
    return kept, missing, errors


def _stats(y_true: list[str], y_pred: list[str], n_boot: int, seed: int) -> dict:
    if not y_true:
        return {"n": 0, "agreement": None, "kappa": None, "kappa_ci": None}
    return {"n": len(y_true), "agreement": agreement(y_true, y_pred), "kappa": cohen_kappa(y_true, y_pred),
            "kappa_ci": list(bootstrap_kappa(y_true, y_pred, n=n_boot, seed=seed))}


def audit_report(records: Sequence[LabelRecord], judged: Mapping[str, Mapping | JudgedTurn],
                 judged_b: Mapping[str, Mapping | JudgedTurn] | None = None, examples: int = 10, *,
                 n_boot: int = 1000, seed: int = 0) -> dict:
    """Compare labels with the judge's verdicts (and, given `judged_b`, a second prompt version's).

    A labelled turn the judge never saw counts as `missing`; one it saw but gave no label counts as a
    `judge_error`; both are left out of every statistic (a judge error is never an agreement). Returns a
    JSON-able dict (see `write_audit` for how it reads)."""
    ids = Counter(r.case_id for r in records)
    dup = sorted(c for c, k in ids.items() if k > 1)
    if dup:
        raise ValueError(f"labels given more than once for case ids {dup[:5]}")
    a = _judged(judged, "judged")
    kept, missing, errors = _pairs(records, a)
    y_true = [r.label for r in kept]
    y_pred = [a[r.case_id].label for r in kept]
    sources = dict(sorted(Counter(r.source for r in records).items()))
    report = {
        **_stats(y_true, y_pred, n_boot, seed),
        "kappa_ci_level": 0.95,
        "n_labels": len(records),
        "missing": missing,
        "judge_errors": errors,
        "label_sources": sources,
        "source": next(iter(sources)) if len(sources) == 1 else ("mixed" if sources else None),
        "prompt": _prompts(a[r.case_id] for r in kept),
        "per_skill": per_skill_table([r.skill for r in kept], y_true, y_pred) if kept else {},
        "confusion": {"labels": list(LABELS), "rows": "label", "columns": "judge",
                      "matrix": confusion(y_true, y_pred) if kept else [[0] * len(LABELS) for _ in LABELS]},
        "disagreements": [
            {"case_id": r.case_id, "skill": r.skill, "label": r.label, "judge_label": a[r.case_id].label,
             "judge_rationale": a[r.case_id].rationale, "label_source": r.source, "label_note": r.note}
            for r in kept if r.label != a[r.case_id].label][:examples],
    }
    if judged_b is not None:
        report["compare"] = _compare(records, a, _judged(judged_b, "judged_b"), n_boot, seed)
    return report


def _compare(records: Sequence[LabelRecord], a: dict[str, JudgedTurn], b: dict[str, JudgedTurn], n_boot: int,
             seed: int) -> dict:
    """Version A against version B on the turns both judged (with a label)."""
    kept_b, missing_b, errors_b = _pairs(records, b)
    both = [r for r in kept_b if a.get(r.case_id) is not None and a[r.case_id].label is not None]
    y = [r.label for r in both]
    ya = [a[r.case_id].label for r in both]
    yb = [b[r.case_id].label for r in both]
    out = {"n": len(both),
           "a": {**_stats(y, ya, n_boot, seed), "prompt": _prompts(a[r.case_id] for r in both)},
           "b": {**_stats(y, yb, n_boot, seed), "prompt": _prompts(b[r.case_id] for r in both),
                 "missing": missing_b, "judge_errors": errors_b},
           "mcnemar": mcnemar([t == p for t, p in zip(y, ya, strict=True)],
                              [t == p for t, p in zip(y, yb, strict=True)]),
           "per_skill": {}}
    if both:
        pa = per_skill_table([r.skill for r in both], y, ya)
        pb = per_skill_table([r.skill for r in both], y, yb)
        out["per_skill"] = {s: {"n": pa[s]["n"], "agreement_a": pa[s]["agreement"],
                                "agreement_b": pb[s]["agreement"]} for s in pa}
    return out


# ---- writing --------------------------------------------------------------------------------------------------

def _num(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ci(ci) -> str:
    return "" if not ci else f" (95% CI {_num(ci[0])} to {_num(ci[1])})"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _prompt_text(prompts: list[dict]) -> str:
    if not prompts:
        return "n/a"
    return ", ".join(f"v{p['version']}" + (f" ({p['hash'][:12]})" if p.get("hash") else "") for p in prompts)


def _source_text(report: dict) -> list[str]:
    sources = report.get("label_sources") or {}
    counts = ", ".join(f"{k}: {v}" for k, v in sources.items()) or "none"
    lines = [f"Labels: {report['n_labels']} turns; source {report.get('source')} ({counts})."]
    if "oracle" in sources:
        lines += ["", "> **These are oracle labels**, computed from the sandbox's ground truth by "
                      "`reward_engine.oracle`, **not human labels**. Agreement with them says how well the judge "
                      "recovers what the simulator knows, not how well it agrees with people."]
    if "judge" in sources:
        lines += ["", "> Some labels come from a judge: agreement with them is agreement between judges."]
    return lines


def render_markdown(report: dict, title: str) -> str:
    """The audit as a Markdown page: headline, per-skill table, confusion matrix, disagreements, A vs B."""
    ref = report.get("source") or "label"
    md = [f"# {title}", "", *_source_text(report), "", "## Headline", "", "| | |", "|---|---|",
          f"| turns compared | {report['n']} |",
          f"| agreement | {_num(report['agreement'])} |",
          f"| Cohen's kappa | {_num(report['kappa'])}{_ci(report.get('kappa_ci'))} |",
          f"| missing (labelled, never judged) | {report['missing']} |",
          f"| judge errors (no verdict; left out of the statistics) | {report['judge_errors']} |",
          f"| prompt | {_cell(_prompt_text(report.get('prompt') or []))} |", ""]
    md += ["## Per skill", "", "| skill | n | agreement | kappa |", "|---|---:|---:|---:|"]
    md += [f"| {_cell(s)} | {v['n']} | {_num(v['agreement'])} | {_num(v['kappa'])} |"
           for s, v in report["per_skill"].items()] or ["| (none) | 0 | n/a | n/a |"]
    labels, matrix = report["confusion"]["labels"], report["confusion"]["matrix"]
    md += ["", f"## Confusion matrix (rows: {ref} label, columns: judge)", "",
           "| label \\ judge | " + " | ".join(labels) + " | total |", "|---" * (len(labels) + 2) + "|"]
    md += [f"| **{lab}** | " + " | ".join(str(c) for c in row) + f" | {sum(row)} |"
           for lab, row in zip(labels, matrix, strict=True)]
    md += ["", f"## Disagreements (first {len(report['disagreements'])})", ""]
    for i, d in enumerate(report["disagreements"], 1):
        md.append(f"{i}. `{d['case_id']}` ({_skill_name(d['skill'])}): {ref} says **{d['label']}**, judge says "
                  f"**{d['judge_label']}**. Judge's rationale: {_cell(d['judge_rationale']) or '(none)'}."
                  + (f" Label note: {_cell(d['label_note'])}." if d.get("label_note") else ""))
    if not report["disagreements"]:
        md.append("None.")
    if "compare" in report:
        c = report["compare"]
        mc = c["mcnemar"]
        md += ["", "## Prompt A vs B (McNemar)", "",
               f"On the {c['n']} turns both versions judged:", "",
               "| | prompt | agreement | kappa |", "|---|---|---:|---:|",
               f"| A | {_cell(_prompt_text(c['a']['prompt']))} | {_num(c['a']['agreement'])} | "
               f"{_num(c['a']['kappa'])}{_ci(c['a'].get('kappa_ci'))} |",
               f"| B | {_cell(_prompt_text(c['b']['prompt']))} | {_num(c['b']['agreement'])} | "
               f"{_num(c['b']['kappa'])}{_ci(c['b'].get('kappa_ci'))} |", "",
               f"A right and B wrong: {mc['b01']}; A wrong and B right: {mc['b10']}. "
               f"{mc['test'].capitalize()} test, two-sided p = {mc['p_value']:.4g}"
               + (" (the versions differ at the 5% level)." if mc["p_value"] < 0.05 else
                  " (no significant difference at the 5% level)."),
               f"B also missed {c['b']['missing']} labelled turns and gave no verdict on {c['b']['judge_errors']}."]
    return "\n".join(md) + "\n"


def _save_figure(fig, path: Path) -> Path:
    with atomic_target(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    return path


def _new_figure(size: tuple[float, float]):
    # an Agg canvas of our own: no pyplot, no global backend switch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_confusion(report: dict, path: Path, title: str) -> Path:
    labels, matrix = report["confusion"]["labels"], np.asarray(report["confusion"]["matrix"])
    fig = _new_figure((6.5, 5.5))
    ax = fig.add_subplot()
    im = ax.imshow(matrix, cmap="Blues", vmin=0, vmax=max(1, int(matrix.max())))
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            dark = matrix[i, j] > 0.6 * max(1, matrix.max())
            ax.text(j, i, str(matrix[i, j]), ha="center", va="center", color="white" if dark else "black")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("judge label")
    ax.set_ylabel(f"{report.get('source') or 'reference'} label")
    ax.set_title(f"{title}\nn={report['n']}, kappa={_num(report['kappa'], 2)}", fontsize=10)
    from matplotlib.ticker import MaxNLocator
    fig.colorbar(im, ax=ax, shrink=0.8, ticks=MaxNLocator(integer=True))
    return _save_figure(fig, path)


def plot_per_skill(report: dict, path: Path, title: str) -> Path:
    fig = _new_figure((max(6.0, 1.0 + 0.9 * max(1, len(report["per_skill"]))), 4.5))
    ax = fig.add_subplot()
    compare = report.get("compare")
    if compare and compare["per_skill"]:
        table = compare["per_skill"]
        series = [(f"prompt A: {_prompt_text(compare['a']['prompt'])}", [v["agreement_a"] for v in table.values()]),
                  (f"prompt B: {_prompt_text(compare['b']['prompt'])}", [v["agreement_b"] for v in table.values()])]
    else:
        table = report["per_skill"]
        series = [(f"prompt {_prompt_text(report.get('prompt') or [])}", [v["agreement"] for v in table.values()])]
    if not table:
        ax.text(0.5, 0.5, "no judged turns", ha="center", va="center", transform=ax.transAxes)
    x = np.arange(len(table))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        ax.bar(x + (k - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, [f"{s}\n(n={v['n']})" for s, v in table.items()], fontsize=8)
    ax.set_ylim(0, 1.18)                       # room for the legend above the bars
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_ylabel("agreement with label")
    ax.set_title(title, fontsize=10)
    if table:
        ax.legend(loc="upper center", ncols=len(series), fontsize=8, frameon=False)
    return _save_figure(fig, path)


def write_audit(report: dict, out_dir: str | Path, title: str) -> dict[str, Path]:
    """Write `audit.json`, `report.md`, `confusion.png` and `per_skill.png` into `out_dir`, each atomically."""
    out = Path(out_dir)
    return {
        "json": write_text_atomic(out / "audit.json", json.dumps(report, indent=2, sort_keys=True) + "\n"),
        "markdown": write_text_atomic(out / "report.md", render_markdown(report, title)),
        "confusion": plot_confusion(report, out / "confusion.png", title),
        "per_skill": plot_per_skill(report, out / "per_skill.png", title),
    }
