"""The browser track: real Chromium through Playwright, MiniWoB++ pages through the gameAPI shim, a local game
folder that speaks gameAPI itself, the paused clock, isolation, metrics and bad input. Needs Debian's chromium
and tesseract-ocr (`bash .ci/system-deps`); without them these tests skip, except in CI where they must run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from evaluation.browser import (BrowserPolicySpec, BrowserTask, EnvFailure, check_action, get_task,
                                load_catalogue)

DATA = Path(__file__).parent / "data"
HAVE = shutil.which("chromium") is not None and shutil.which("tesseract") is not None
try:
    import miniwob  # noqa: F401
    import playwright  # noqa: F401
except ImportError:
    HAVE = False
needs_browser = pytest.mark.skipif(not HAVE and not os.environ.get("CI"),
                                   reason="needs chromium, tesseract-ocr (bash .ci/system-deps) and the browser extra")


def _catalogue(tmp_path, **over) -> Path:
    tasks = [{"task_id": "counter", "game_id": f"folder:{DATA / 'counter_game'}", "max_steps": 6,
              "target_score": 3.0, **over},
             {"task_id": "stuck", "game_id": f"folder:{DATA / 'stuck_game'}", "max_steps": 3,
              "ready_timeout_ms": 500}]
    p = tmp_path / "tasks.yaml"
    p.write_text(yaml.safe_dump({"defaults": {"semantic_actions": {"click_text": "text"}}, "tasks": tasks}))
    return p


# --------------------------------------------------------------------------- no browser needed


def test_unknown_task_lists_the_catalogue():
    with pytest.raises(ValueError, match="click-button") as e:
        get_task("click-nothing")
    assert "unknown browser task 'click-nothing'" in str(e.value)
    assert len(load_catalogue()) >= 5
    res = CliRunner().invoke(__import__("pipeline.cli", fromlist=["app"]).app,
                             ["eval", "recipes/ci.yaml", "--env", "browser:nope", "--out", "/tmp/x"])
    assert res.exit_code == 2 and "click-tab" in res.output


def test_action_space_checks():
    task = BrowserTask(task_id="t", game_id="miniwob/click-button", max_steps=3,
                       semantic_actions={"click_text": "text"})
    size = (320, 420)
    assert check_action(None, task, "computer", size) == "no_tool_call"
    assert check_action("click somewhere", task, "computer", size) == "no_tool_call"
    assert check_action({"name": "click", "arguments": {"x": 10, "y": 10}}, task, "computer", size) is None
    assert check_action({"name": "click", "arguments": {"x": 400, "y": 10}}, task, "computer", size) == "out_of_space"
    assert check_action({"name": "click", "arguments": {"x": 1}}, task, "computer", size) == "out_of_space"
    assert check_action({"name": "drag", "arguments": {}}, task, "computer", size) == "out_of_space"
    assert check_action({"name": "type", "arguments": {"text": "hi"}}, task, "computer", size) is None
    assert check_action({"name": "click_text", "arguments": {"text": "OK"}}, task, "semantic", size) is None
    assert check_action({"name": "click", "arguments": {"x": 1, "y": 1}}, task, "semantic", size) == "out_of_space"


def test_instruction_parsing_and_location():
    from evaluation.browser_agent import Word, locate, parse_instruction
    assert [t.text for t in parse_instruction('Click on the "Okay" button.')] == ["Okay"]
    assert [t.text for t in parse_instruction("Click button ONE, then click button TWO.")] == ["ONE", "TWO"]
    assert [t.text for t in parse_instruction("Click on Tab #2.")] == ["Tab #2"]
    assert parse_instruction('Click on the link "tellus".')[0].kind == "link"
    frame = np.full((100, 100, 3), 255, dtype=np.uint8)
    frame[:20] = (255, 255, 0)                                 # the instruction box
    words = [Word('"ok"', 10, 5, 20, 10, 95), Word("ok", 40, 60, 20, 10, 95), Word("Tab", 10, 80, 20, 10, 90),
             Word("#2", 35, 80, 15, 10, 90)]
    from evaluation.browser_agent import Target
    assert locate(frame, words, Target("ok")) == (50, 65)      # never the word inside the instruction
    assert locate(frame, words, Target("Tab #2")) == ((10 + 50) // 2, 85)
    assert locate(frame, words, Target("Cancel")) is None


# --------------------------------------------------------------------------- real browser


@needs_browser
def test_paused_clock_makes_episodes_independent_of_thinking_time():
    """Same seed and actions -> same states, rewards and screenshots, whether the policy answers at once or
    after two seconds; the page's own clock only moves by the step duration."""
    from evaluation.browser import BrowserEnv
    task = get_task("click-button")
    actions = [{"name": "move", "arguments": {"x": 5, "y": 300}}, {"name": "click", "arguments": {"x": 300, "y": 400}}]

    def play(sleep: float):
        with BrowserEnv(task) as env:
            frame, st = env.reset(seed=7)
            out = [(st, hashlib.sha256(frame.tobytes()).hexdigest())]
            for a in actions:
                time.sleep(sleep)
                r = env.step(a)
                out.append((r["state"], r["score"], hashlib.sha256(env.screenshot().tobytes()).hexdigest()))
        return out

    fast, slow = play(0.0), play(2.0)
    assert fast == slow
    elapsed = [s[0]["game_state"]["elapsed_ms"] for s in fast[1:]]
    assert elapsed == [task.step_ms, 2 * task.step_ms]        # page time, not wall time
    assert fast[0][0]["game_state"]["utterance"].startswith("Click on the")


@needs_browser
def test_a_real_time_task_runs_the_clock_for_the_thinking_time(tmp_path):
    from evaluation.browser import BrowserEnv
    task = get_task("counter", _catalogue(tmp_path, pause_during_inference=False, step_ms=100))
    with BrowserEnv(task) as env:
        env.reset(seed=0)
        r = env.step({"name": "move", "arguments": {"x": 1, "y": 1}}, think_ms=1000)
        assert r["state"]["game_state"]["ticks"] == 11            # 1000 ms thinking + 100 ms step, 100 ms ticks
        assert env.blocked and all(u.startswith("http://example.com") for u in env.blocked)  # never left the machine


@needs_browser
def test_expert_on_miniwob_through_an_isolated_policy_process(tmp_path):
    from evaluation.browser import evaluate_browser
    m = evaluate_browser("click-button", "expert", 3, tmp_path, seed=100)
    assert m["success_rate"] == 1.0 and m["env_failures"] == 0 and m["invalid_action_rate"] == 0.0
    from evaluation.isolation import PAYLOAD_KEYS
    assert m["payload_keys"] and all(set(k) <= PAYLOAD_KEYS for k in m["payload_keys"])  # screenshot + text only
    assert (tmp_path / "strip_0.png").stat().st_size > 1000 and "Wilson" in (tmp_path / "report.md").read_text()
    rows = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert all(r["actions"][0]["action"]["name"] == "click" for r in rows)   # computer-use clicks from OCR
    rnd = evaluate_browser("click-button", "random", 3, tmp_path / "random", seed=100)
    assert rnd["success_rate"] < 1.0


@needs_browser
def test_the_policy_process_cannot_reach_the_browser():
    from evaluation.isolation import PolicyProcess
    frame = np.full((420, 320, 3), 255, dtype=np.uint8)
    with PolicyProcess(BrowserPolicySpec(policy="random")) as proc:
        r = proc.call(op="reset", mission="Click on the \"ok\" button.", frame=frame, seed=1)
        assert r["action"]["name"] == "click"
        probe = proc.call(op="probe")
        assert probe["browser_objects"] == 0 and probe["env_objects"] == 0 and probe["pid"] == proc.pid
        with pytest.raises(ValueError, match="may not receive"):
            proc.call(op="act", frame=frame, state={"score": 1})


@needs_browser
def test_a_local_game_folder_plugs_in_with_both_interfaces(tmp_path):
    """A game that defines window.gameAPI itself runs unchanged: semantic and computer-use presses count, the
    terminal state ends the episode, and the evaluator's metrics follow the game's score fields."""
    from evaluation.browser import BrowserEnv, evaluate_browser
    from evaluation.browser_agent import locate, ocr_words, Target
    cat = _catalogue(tmp_path)
    task = get_task("counter", cat)
    with BrowserEnv(task) as env:
        frame, st = env.reset(seed=1)
        assert st["game_state"]["utterance"] == "Press the button 3 times." and st["is_actionable"]
        r = env.step({"name": "click_text", "arguments": {"text": "Press"}}, "semantic")
        assert r["invalid"] is None and r["score"] == 1.0
        r = env.step({"name": "click_text", "arguments": {"text": "Nothing"}}, "semantic")
        assert r["invalid"] == "out_of_space" and "no element" in r["detail"] and r["score"] == 1.0
        x, y = locate(frame, ocr_words(frame), Target("Press"))
        for want in (2.0, 3.0):
            r = env.step({"name": "click", "arguments": {"x": x, "y": y}})
            assert r["score"] == want
        assert r["state"]["status"] == "terminal" and r["state"]["terminal"]["outcome"] == "win"
    m = evaluate_browser("counter", "random", 2, tmp_path / "rnd", seed=0, catalogue=cat)
    assert m["env_failures"] == 0 and 0.0 <= m["progress"] <= 1.0 and m["blocked_requests"] >= 2
    assert m["mean_steps"] <= task.max_steps and m["invalid_action_rate"] == 0.0


@needs_browser
def test_a_page_that_never_becomes_actionable_is_an_environment_failure(tmp_path):
    from evaluation.browser import BrowserEnv, evaluate_browser
    cat = _catalogue(tmp_path)
    with BrowserEnv(get_task("stuck", cat)) as env:
        with pytest.raises(EnvFailure, match="never became actionable within 500 ms"):
            env.reset(0)
    m = evaluate_browser("stuck", "expert", 2, tmp_path / "out", catalogue=cat)
    assert m["env_failures"] == 2 and m["played"] == 0 and m["success_rate"] is None
    assert m["outcomes"] == {"env_failure": 2}


@needs_browser
def test_reset_on_fail_keeps_playing_within_the_step_budget(tmp_path):
    """The catalogue's click-button-retry: a random policy loses, the page resets, it plays on within the 8
    steps; an episode won after a loss has progress 1 (the best score kept)."""
    from evaluation.browser import evaluate_browser, get_task
    assert get_task("click-button-retry").continue_on_fail
    m = evaluate_browser("click-button-retry", "random", 4, tmp_path / "out", seed=0)
    rows = [json.loads(x) for x in (tmp_path / "out" / "episodes.jsonl").read_text().splitlines()]
    assert m["resets_on_fail"] >= 1 and all(r["steps"] <= 8 for r in rows)
    assert any(r["resets"] and r["steps"] > 1 for r in rows)
    assert all(r["progress"] == (1.0 if r["success"] else 0.0) for r in rows)


def test_online_perception_and_a_chat_model_policy_over_http():
    """VisionOCR (any OpenAI-compatible vision model) reads words from its JSON reply; a bad reply reads as no
    words, counted. BrowserModel sends the words and the computer-use tools and reads the tool call back."""
    from agent.clients import OpenAIClient
    from evaluation.browser_agent import BrowserExpert, BrowserModel, VisionOCR
    from fake_openai import FakeOpenAI, Reply

    frame = np.full((420, 320, 3), 255, dtype=np.uint8)

    def responder(body, n):
        if body.get("tools"):
            assert "Submit @ 50,60" in body["messages"][1]["content"]
            assert {t["function"]["name"] for t in body["tools"]} == {"click", "move", "key", "type"}
            return Reply("", tool_calls=[{"name": "click", "arguments": {"x": 50, "y": 60}}])
        content = body["messages"][0]["content"]
        assert content[1]["type"] == "image_url" and content[1]["image_url"]["url"].startswith("data:image/png")
        return Reply("not json" if n == 1 else json.dumps([{"text": "Submit", "x": 40, "y": 55, "w": 20, "h": 10}]))

    with FakeOpenAI(responder) as srv:
        client = OpenAIClient("vision", base_url=srv.base_url, timeout=2.0, max_retries=0, backoff=0.01)
        ocr = VisionOCR(client)
        words = ocr(frame)
        assert [(w.text, w.centre) for w in words] == [("Submit", (50, 60))]
        assert ocr(frame) == [] and ocr.errors == 1
        expert = BrowserExpert("computer", perceive=VisionOCR(client))
        expert.reset('Click on the "Submit" button.', 0)
        action, info = expert.act(frame)
        assert action == {"name": "click", "arguments": {"x": 50, "y": 60}}
        model = BrowserModel(client, "act", perceive=lambda f: words)
        model.reset("Click Submit.", 3)
        action, info = model.act(frame)
        assert action == {"name": "click", "arguments": {"x": 50, "y": 60}}
