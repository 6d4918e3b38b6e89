"""The main job as a user runs it (`embodistill rl RECIPE`, what `accelerate launch rl/train_gigpo.py RECIPE` runs):
distill, SFT and RL in one process, one progress bar per stage, the raw logs in files, a closing table; and the
stages before RL leave nothing behind that changes RL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The ci recipe with its SFT in bf16 autocast (what `bf16: auto` does on a CPU with native bf16): the SFT
    trainer sets up accelerate's mixed precision in this process, which RL must not inherit."""
    folder = tmp_path_factory.mktemp("main_job")
    recipe = yaml.safe_load((ROOT / "recipes" / "ci.yaml").read_text())
    recipe["sft"]["bf16"] = True
    (folder / "ci.yaml").write_text(yaml.safe_dump(recipe))
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "rl", "ci.yaml"], cwd=folder, capture_output=True,
                       timeout=1200)   # bytes: text mode would turn the bars' carriage returns into new lines
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, r.stderr[-4000:]
    return folder, r


def test_every_stage_runs_and_the_run_ends_with_a_table(main_job):
    folder, r = main_job
    out = folder / "outputs" / "ci"
    assert (out / "distill" / "dataset" / "README.md").is_file() and (out / "sft" / "final").is_dir()
    assert (out / "onpolicy" / "final").is_dir()
    summary = json.loads((out / "rl" / "gigpo" / "metrics.json").read_text())
    assert summary["iterations"] == 2
    table = r.stdout
    assert "what each stage did" in table and "TSR before RL -> after RL" in table
    for stage in ("distill", "sft", "onpolicy", "rl (gigpo)"):
        assert stage in table
    before, after = summary["initial_eval"]["all"]["tsr"], summary["final_eval"]["all"]["tsr"]
    assert f"{before:.4f}" in table and f"{after:.4f}" in table
    assert "outputs/ci/onpolicy/final" in table and "curves.png" in table


def test_raw_logs_go_to_files_not_the_terminal(main_job):
    folder, r = main_job
    out = folder / "outputs" / "ci"
    sft_log = (out / "sft" / "log.txt").read_text()
    assert "assistant-only step" in sft_log and '"loss"' in sft_log   # the trainer's records, in the file
    assert (out / "distill" / "log.txt").is_file() and (out / "rl" / "gigpo" / "log.txt").is_file()
    assert (out / "onpolicy" / "log.txt").is_file()
    terminal = r.stdout + r.stderr
    assert "{'loss'" not in terminal and '"loss":' not in terminal and "'eval_loss'" not in terminal
    # one bar per stage (distill, sft, onpolicy, rl): a bar redraws itself with carriage returns on its own line
    bars = [ln for ln in r.stderr.split("\n") if "%|" in ln]
    assert [b.rsplit("\r", 1)[-1].split(":")[0] for b in bars] == ["distill", "sft", "onpolicy", "rl"], bars


def test_the_stages_before_rl_leave_rl_unchanged(main_job):
    """RL in the process that just ran SFT (with bf16 autocast) ends bit for bit where RL from the same checkpoint
    ends in a fresh process: no environment variable, thread count or accelerate state leaks from SFT."""
    folder, _ = main_job
    fresh = subprocess.run([sys.executable, "-m", "pipeline.cli", "rl", "ci.yaml", "--out", "outputs/ci/rl/again",
                            "--quiet"], cwd=folder, capture_output=True, text=True, timeout=1200)
    assert fresh.returncode == 0, fresh.stderr[-4000:]
    a = _weights(folder / "outputs" / "ci" / "rl" / "gigpo" / "final")
    b = _weights(folder / "outputs" / "ci" / "rl" / "again" / "final")
    assert all(a[k].equal(b[k]) for k in a)


def test_the_table_takes_before_rl_from_the_onpolicy_stage_only_where_it_played_the_same_episodes(capsys):
    """`rl.eval_start: false` (medium): RL does not evaluate its start again; the closing table's "before" is the
    on-policy stage's last evaluation of the same student, block by block, and "—" where it has none."""
    from pipeline.console import print_tables
    from pipeline.main_job import _evaluation_rows
    ev = lambda n, t: {"episodes": n, "tsr": t}  # noqa: E731
    summary = {"initial_eval": None, "final_eval": {"all": ev(338, 0.6775), "hard": ev(57, 0.4912),
                                                    "pool": ev(96, 0.6875)}}
    start = {"all": ev(338, 0.6509), "hard": ev(56, 0.45)}   # "hard": another number of episodes
    rows = _evaluation_rows(summary, start)
    assert rows == {"test, hard": (57, None, 0.4912), "test, all": (338, 0.6509, 0.6775),
                    "RL pool sample": (96, None, 0.6875)}
    with_start = _evaluation_rows({**summary, "initial_eval": {"all": ev(338, 0.64)}}, start)
    assert with_start["test, all"] == (338, 0.64, 0.6775)   # RL's own evaluation of its start comes first
    print_tables([], rows, before_note="the on-policy stage's last evaluation")
    out = capsys.readouterr().out
    assert "0.6509" in out and "—" in out and "before RL: the on-policy stage's last evaluation" in out
