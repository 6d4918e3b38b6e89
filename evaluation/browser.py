"""Browser pixel track with GameWorld's protocol: Playwright + system Chromium, a paused page clock, a gameAPI
state bridge, MiniWoB++ tasks (and any local game folder that speaks gameAPI).

The evaluator (this module) owns the browser. It sends the policy process (`evaluation.isolation`) only the
screenshot and the instruction, executes the one action that comes back, and alone reads the game's state
through `window.gameAPI` (`init`, `reset({seed})`, `getState()` -> status loading / playing / terminal,
`is_actionable`, the terminal outcome and `game_state` with the score fields). For MiniWoB++ pages a shim
injected before the page's scripts provides that contract from the `WOB_*` globals and the raw reward (never
the time-discounted one).

Paused evaluation: Playwright's clock is installed and paused before the page loads. Each action is executed,
then the page runs for the task's `step_ms` of page time and pauses again, so what happens does not depend on
how long the policy took (a test sleeps two seconds between actions to prove it). After a reset a readiness
gate runs the page in small slices until `is_actionable`; a page that never gets there is an environment
failure (recorded apart from policy failures), not a lost episode.

    embodistill eval recipes/tiny.yaml --env browser:click-button --policy expert --episodes 50 --out DIR

writes `metrics.json`, `episodes.jsonl`, `report.md` and screenshot strips, like the BabyAI track.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field

CATALOGUE = Path(__file__).with_name("browser_tasks.yaml")
COMPUTER_ACTIONS = {"click": ("x", "y"), "move": ("x", "y"), "key": ("key",), "type": ("text",)}
INTERFACES = ("computer", "semantic")
T0_MS = 1_700_000_000_000           # the page clock's epoch: every episode starts at the same page time
CHROMIUM_FLAGS = [                  # headless, no GPU, and off the network: names resolve nowhere, no updates
    "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
    "--disable-background-networking", "--disable-component-update", "--disable-default-apps",
    "--metrics-recording-only", "--mute-audio", "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]

# The gameAPI contract for a MiniWoB++ page, injected before its scripts run (it reads core/WOB_* lazily).
MINIWOB_SHIM = r"""
(() => {
  const started = () => {
    const c = document.getElementById('sync-task-cover');
    return !!c && c.style.display === 'none';
  };
  window.gameAPI = {
    init() {
      return {ready: typeof core !== 'undefined' && typeof genProblem === 'function'
                     && document.readyState === 'complete'};
    },
    reset(opts) {
      Math.seedrandom(String((opts && opts.seed) || 0));
      core.startEpisodeReal();
      return window.gameAPI.getState();
    },
    getState() {
      if (typeof core === 'undefined' || typeof WOB_DONE_GLOBAL === 'undefined')
        return {status: 'loading', is_actionable: false, terminal: null, game_state: {}};
      const status = WOB_DONE_GLOBAL ? 'terminal' : (started() ? 'playing' : 'loading');
      return {
        status: status,
        is_actionable: status === 'playing' && WOB_TASK_READY !== false,
        terminal: WOB_DONE_GLOBAL ? {outcome: WOB_RAW_REWARD_GLOBAL > 0 ? 'win' : 'loss',
                                     reason: WOB_REWARD_REASON} : null,
        game_state: {score: WOB_RAW_REWARD_GLOBAL, episode_id: WOB_EPISODE_ID, utterance: core.getUtterance(),
                     elapsed_ms: core.ept0 === null ? 0 : new Date().getTime() - core.ept0},
      };
    },
  };
})();
"""

# Semantic action -> the centre of the first visible element (DOM order) whose own text is exactly the argument.
FIND_TEXT = r"""
(text) => {
  const want = String(text).trim();
  const all = Array.from(document.querySelectorAll('#area *, body *'));
  for (const el of all) {
    if (el.id === 'query' || el.closest('#query') || el.closest('#reward-display')) continue;
    const own = (el.innerText || el.value || '').trim();
    if (own !== want) continue;
    if (Array.from(el.children).some(c => (c.innerText || '').trim() === want)) continue;  // the deepest one
    const r = el.getBoundingClientRect();
    if (r.width < 1 || r.height < 1) continue;
    return {x: r.left + r.width / 2, y: r.top + r.height / 2};
  }
  return null;
}
"""


class BrowserUnavailable(RuntimeError):
    """No Chromium or no Playwright here: says how to install them (never `playwright install`)."""


class EnvFailure(RuntimeError):
    """The page never became actionable (or broke): an environment failure, not a policy failure."""


class BrowserTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str
    game_id: str
    max_steps: int = Field(ge=1)
    score_field: str = "score"
    start_score: float = 0.0
    target_score: float = 1.0
    pause_during_inference: bool = True
    continue_on_fail: bool = False
    step_ms: int = Field(default=200, ge=1)
    semantic_actions: dict[str, str] = Field(default_factory=dict)
    prompt: str = ""
    ready_timeout_ms: int = Field(default=5000, ge=50)


def load_catalogue(path: str | Path = CATALOGUE) -> dict[str, BrowserTask]:
    path = Path(path)
    raw = yaml.safe_load(path.read_text())
    defaults = raw.get("defaults", {})
    out = {}
    for i, t in enumerate(raw.get("tasks", [])):
        try:
            task = BrowserTask.model_validate({**defaults, **t})
        except Exception as e:
            raise ValueError(f"{path}: task {i}: {e}") from e
        if task.game_id.startswith("folder:"):
            folder = Path(task.game_id[7:])
            if not folder.is_absolute():
                task = task.model_copy(update={"game_id": "folder:" + str((path.parent / folder).resolve())})
        out[task.task_id] = task
    return out


def get_task(task_id: str, catalogue: str | Path = CATALOGUE) -> BrowserTask:
    tasks = load_catalogue(catalogue)
    if task_id not in tasks:
        raise ValueError(f"unknown browser task {task_id!r}; the catalogue ({catalogue}) has: {', '.join(tasks)}")
    return tasks[task_id]


def find_chromium() -> str:
    for cand in (os.environ.get("EMBODISTILL_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if cand and (shutil.which(cand) or Path(cand).is_file()):
            return shutil.which(cand) or cand
    raise BrowserUnavailable("no Chromium found: install Debian's package (`apt-get install chromium`) or set "
                             "EMBODISTILL_CHROMIUM to a Chromium binary (never `playwright install`)")


def miniwob_html() -> Path:
    try:
        import miniwob
    except ImportError as e:
        raise BrowserUnavailable("the MiniWoB++ tasks come with the `miniwob` package: pip install -e '.[browser]'"
                                 ) from e
    return Path(miniwob.__file__).parent / "html"


def game_url(task: BrowserTask) -> tuple[str, str | None]:
    """(page URL, script to inject before the page's own scripts)."""
    kind, _, name = task.game_id.partition("/") if task.game_id.startswith("miniwob/") else \
        task.game_id.partition(":")
    if kind == "miniwob":
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or ".." in name:
            raise ValueError(f"{task.task_id}: a MiniWoB++ page is named by letters, digits, '.', '_' and '-', "
                             f"not {name!r}")
        page = miniwob_html() / "miniwob" / f"{name}.html"
        if not page.is_file():
            raise ValueError(f"{task.task_id}: no MiniWoB++ page {name!r} in {page.parent}")
        return page.as_uri(), MINIWOB_SHIM
    if kind == "folder":
        folder = Path(name)
        if not (folder / "index.html").is_file():
            raise ValueError(f"{task.task_id}: {folder} has no index.html")
        shim = folder / "gameapi.js"
        return (folder / "index.html").as_uri(), shim.read_text() if shim.is_file() else None
    raise ValueError(f"{task.task_id}: game_id must be miniwob/<page> or folder:<path>, not {task.game_id!r}")


def check_action(action, task: BrowserTask, interface: str, size: tuple[int, int]) -> str | None:
    """None when the action is in the task's space for this interface; else `no_tool_call` (nothing readable
    came back) or `out_of_space` (an unknown action, wrong arguments, a point off the screenshot of `size`)."""
    if not isinstance(action, dict) or not isinstance(action.get("name"), str):
        return "no_tool_call"
    args = action.get("arguments") if isinstance(action.get("arguments"), dict) else {}
    if interface == "computer":
        want = COMPUTER_ACTIONS.get(action["name"])
        if want is None or set(args) != set(want):
            return "out_of_space"
        if action["name"] in ("click", "move"):
            x, y = args.get("x"), args.get("y")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)) or \
                    not (0 <= x < size[0] and 0 <= y < size[1]):
                return "out_of_space"
        elif not isinstance(next(iter(args.values())), str):
            return "out_of_space"
        return None
    arg = task.semantic_actions.get(action["name"])
    if arg is None or set(args) != {arg} or not isinstance(args[arg], str):
        return "out_of_space"
    return None


class BrowserEnv:
    """One task in a fresh headless Chromium (a new profile per env), driven through Playwright's sync API."""

    def __init__(self, task: BrowserTask, scale: int = 2, viewport: tuple[int, int] = (160, 210),
                 executable: str | None = None):
        try:
            from playwright.sync_api import sync_playwright
        except ImportError as e:
            raise BrowserUnavailable("Playwright is not installed: pip install -e '.[browser]'") from e
        self.task = task
        self.scale = scale
        self.url, self.shim = game_url(task)
        self._pw = sync_playwright().start()
        args = list(CHROMIUM_FLAGS)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--no-sandbox")   # Chromium refuses to run its sandbox as root
        try:
            self.browser = self._pw.chromium.launch(executable_path=executable or find_chromium(), headless=True,
                                                    args=args)
        except Exception:
            self._pw.stop()
            raise
        self.viewport = viewport
        self.page = None
        self.blocked: list[str] = []      # requests that tried to leave the machine
        self.steps = 0

    # ------------------------------------------------------------------ lifecycle

    def _new_page(self) -> None:
        if self.page is not None:
            self.page.context.close()
        ctx = self.browser.new_context(viewport={"width": self.viewport[0], "height": self.viewport[1]},
                                       device_scale_factor=self.scale, service_workers="block")
        ctx.route("**/*", self._route)
        page = ctx.new_page()
        if self.shim:
            page.add_init_script(self.shim)
        page.clock.install(time=T0_MS)
        page.clock.pause_at(T0_MS + 10_000)   # frozen from here on: time moves only through run_for
        self.page = page

    def _route(self, route) -> None:
        url = route.request.url
        if url.startswith(("file://", "data:", "about:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def reset(self, seed: int) -> tuple[np.ndarray, dict]:
        """Fresh page, `gameAPI.reset({seed})`, readiness gate. Returns (screenshot, state). EnvFailure if the
        page never becomes actionable within `ready_timeout_ms` of page time (or 30 s of wall time)."""
        self._new_page()
        self.steps = 0
        try:
            self.page.goto(self.url, wait_until="load", timeout=30_000)
            self._wait(lambda: self.page.evaluate("() => !!window.gameAPI && !!window.gameAPI.init().ready"),
                       "gameAPI.init() never reported ready")
            self.page.evaluate("(seed) => window.gameAPI.reset({seed: seed})", seed)
            self._wait(lambda: bool(self.state().get("is_actionable")), "the game never became actionable")
        except EnvFailure:
            raise
        except Exception as e:
            raise EnvFailure(f"{self.task.task_id}: the page broke during reset: {type(e).__name__}: {e}") from e
        return self.screenshot(), self.state()

    def _wait(self, ok: Callable[[], bool], what: str) -> None:
        spent, deadline = 0, time.time() + 30
        while not ok():
            if spent >= self.task.ready_timeout_ms or time.time() > deadline:
                raise EnvFailure(f"{self.task.task_id}: {what} within {self.task.ready_timeout_ms} ms of page time")
            self.page.clock.run_for(50)
            spent += 50

    def close(self) -> None:
        try:
            if self.page is not None:
                self.page.context.close()
            self.browser.close()
        finally:
            self._pw.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ observation and state

    def screenshot(self) -> np.ndarray:
        from io import BytesIO

        from PIL import Image
        png = self.page.screenshot(animations="disabled", caret="initial")
        return np.asarray(Image.open(BytesIO(png)).convert("RGB"))

    def state(self) -> dict:
        """The evaluator's view: gameAPI.getState() (never given to the policy)."""
        return self.page.evaluate("() => window.gameAPI ? window.gameAPI.getState() : {status: 'loading'}")

    def score(self, st: dict | None = None) -> float:
        st = st or self.state()
        v = (st.get("game_state") or {}).get(self.task.score_field)
        return float(v) if isinstance(v, (int, float)) else self.task.start_score

    # ------------------------------------------------------------------ actions

    def check_action(self, action, interface: str) -> str | None:
        return check_action(action, self.task, interface, (self.viewport[0] * self.scale,
                                                           self.viewport[1] * self.scale))

    def step(self, action, interface: str = "computer", think_ms: float = 0.0) -> dict:
        """Execute one action (if it is in the space), run the page for `step_ms` (plus the policy's thinking
        time when the task does not pause during inference), pause again; return what happened."""
        self.steps += 1
        invalid = self.check_action(action, interface)
        detail = None
        if invalid is None:
            detail = self._execute(action, interface)
            if detail is not None:
                invalid = "out_of_space"
        run = self.task.step_ms + (0 if self.task.pause_during_inference else int(think_ms))
        self.page.clock.run_for(run)
        st = self.state()
        return {"invalid": invalid, "detail": detail, "state": st, "score": self.score(st)}

    def _execute(self, action: dict, interface: str) -> str | None:
        a = action["arguments"]
        m = self.page.mouse
        if interface == "semantic":
            pos = self.page.evaluate(FIND_TEXT, a[self.task.semantic_actions[action["name"]]])
            if pos is None:
                return f"no element with the text {a[self.task.semantic_actions[action['name']]]!r}"
            m.click(pos["x"], pos["y"])
            return None
        name = action["name"]
        if name == "click":
            m.click(a["x"] / self.scale, a["y"] / self.scale)
        elif name == "move":
            m.move(a["x"] / self.scale, a["y"] / self.scale)
        elif name == "key":
            try:
                self.page.keyboard.press(a["key"])
            except Exception as e:  # an unknown key name is the policy's mistake, not a crash
                return f"unknown key {a['key']!r}: {str(e)[:80]}"
        elif name == "type":
            self.page.keyboard.type(a["text"])
        return None


# ----------------------------------------------------------------------------- the policy side's spec


class BrowserPolicySpec(BaseModel):
    """Plain data the policy process builds its agent from (`evaluation.browser_agent`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str                      # expert | random | a model folder
    interface: str = "computer"
    prompt: str = ""
    max_new_tokens: int = 64
    vision_model: str | None = None
    vision_base_url: str | None = None
    vision_api_key_env: str = "OPENAI_API_KEY"

    def build(self):
        from evaluation.browser_agent import build_browser_agent
        return build_browser_agent(self)


# ----------------------------------------------------------------------------- the evaluator


def run_episode(env: BrowserEnv, proc, seed: int, interface: str) -> dict:
    """One episode: the policy sees screenshots and the instruction only; the evaluator reads gameAPI."""
    task = env.task
    row = {"task": task.task_id, "seed": seed, "steps": 0, "success": False, "env_failure": None, "resets": 0,
           "no_tool_call": 0, "out_of_space": 0, "actions": [], "think_s": []}
    frames = []
    blocked_before = len(env.blocked)
    try:
        frame, st = env.reset(seed)
    except EnvFailure as e:
        row.update(env_failure=str(e), progress=0.0, best_score=None, instruction=None, outcome="env_failure")
        return {**row, "frames": frames}
    instruction = (st.get("game_state") or {}).get("utterance") or ""
    row["instruction"] = instruction
    start, target = task.start_score, task.target_score
    best = env.score(st)
    frames.append(frame)
    t = time.perf_counter()
    reply = proc.call(op="reset", mission=instruction, frame=frame, seed=seed)
    think = time.perf_counter() - t
    outcome = "budget"
    while row["steps"] < task.max_steps:
        action = reply.get("action")
        row["think_s"].append(round(think, 3))
        res = env.step(action, interface, think_ms=think * 1000)
        row["steps"] += 1
        if res["invalid"]:
            row[res["invalid"]] += 1
        row["actions"].append({"action": action, "invalid": res["invalid"], "detail": res["detail"],
                               "score": res["score"], "status": res["state"].get("status")})
        best = max(best, res["score"])
        frame = env.screenshot()
        frames.append(frame)
        term = res["state"].get("terminal") if res["state"].get("status") == "terminal" else None
        if term is not None:
            if term.get("outcome") == "win" or res["score"] >= target:
                row["success"], outcome = True, "win"
                break
            outcome = "loss"
            if not task.continue_on_fail or row["steps"] >= task.max_steps:
                break
            try:                               # reset on fail, within the same step budget
                frame, st = env.reset(seed)
            except EnvFailure as e:
                row["env_failure"], outcome = str(e), "env_failure"
                break
            row["resets"] += 1
            frames.append(frame)
            t = time.perf_counter()
            reply = proc.call(op="reset", mission=(st.get("game_state") or {}).get("utterance") or "",
                              frame=frame, seed=seed)
            think = time.perf_counter() - t
            continue
        t = time.perf_counter()
        reply = proc.call(op="act", frame=frame)
        think = time.perf_counter() - t
    span = target - start
    row.update(outcome=outcome, best_score=best,
               progress=float(np.clip((best - start) / span, 0.0, 1.0)) if span else float(best >= target),
               blocked_requests=len(env.blocked) - blocked_before)
    return {**row, "frames": frames}


def summarize(rows: list[dict], task: BrowserTask) -> dict:
    from evaluation.pixel_report import wilson
    played = [r for r in rows if not r["env_failure"] or r["steps"] > 0]
    n = len(played)
    k = sum(r["success"] for r in played)
    acts = sum(r["steps"] for r in played)
    think = [s for r in played for s in r["think_s"]]
    return {"episodes": len(rows), "played": n, "env_failures": sum(bool(r["env_failure"]) for r in rows),
            "success_rate": round(k / n, 4) if n else None, "success_wilson95": list(wilson(k, n)) if n else None,
            "progress": round(float(np.mean([r["progress"] for r in played])), 4) if n else None,
            "mean_steps": round(float(np.mean([r["steps"] for r in played])), 3) if n else None,
            "step_budget": task.max_steps, "actions": acts,
            "invalid_action_rate": round(sum(r["no_tool_call"] + r["out_of_space"] for r in played) / acts, 4)
            if acts else 0.0,
            "no_tool_call_rate": round(sum(r["no_tool_call"] for r in played) / acts, 4) if acts else 0.0,
            "out_of_space_rate": round(sum(r["out_of_space"] for r in played) / acts, 4) if acts else 0.0,
            "resets_on_fail": sum(r["resets"] for r in played),
            "mean_think_s": round(float(np.mean(think)), 4) if think else None,
            "blocked_requests": sum(r.get("blocked_requests", 0) for r in rows),
            "outcomes": {o: sum(r["outcome"] == o for r in rows) for o in sorted({r["outcome"] for r in rows})}}


def evaluate_browser(task_id: str, policy: str, episodes: int, out: Path, seed: int = 0,
                     interface: str = "computer", strips: int = 3, catalogue: str | Path = CATALOGUE,
                     progress: Callable[[int], None] | None = None, vision_model: str | None = None,
                     vision_base_url: str | None = None) -> dict:
    """Episodes with seeds seed .. seed+episodes-1; writes metrics.json, episodes.jsonl, report.md, strips."""
    from agent.trajectory import write_json, write_text_atomic
    from evaluation.pixel_report import write_strip
    from evaluation.isolation import PolicyProcess
    task = get_task(task_id, catalogue)
    if interface not in INTERFACES:
        raise ValueError(f"interface must be one of {', '.join(INTERFACES)}, not {interface!r}")
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, not {episodes}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = BrowserPolicySpec(policy=policy, interface=interface, prompt=task.prompt, vision_model=vision_model,
                             vision_base_url=vision_base_url)
    rows = []
    t0 = time.time()
    with BrowserEnv(task) as env, PolicyProcess(spec) as proc:
        for i in range(episodes):
            r = run_episode(env, proc, seed + i, interface)
            frames = r.pop("frames")
            if i < strips and frames:
                write_strip(frames, out / f"strip_{i}.png")
            rows.append(r)
            if progress:
                progress(1)
        audit = sorted(set(proc.sent))
    m = summarize(rows, task)
    m.update({"task": task_id, "game_id": task.game_id, "policy": policy, "interface": interface, "seed": seed,
              "pause_during_inference": task.pause_during_inference, "step_ms": task.step_ms,
              "continue_on_fail": task.continue_on_fail, "perception": f"vision:{vision_model}" if vision_model
              else "tesseract", "payload_keys": [list(k) for k in audit], "wall_s": round(time.time() - t0, 1)})
    write_text_atomic(out / "episodes.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_json(out / "metrics.json", m)
    write_text_atomic(out / "report.md", report(m, rows))
    return m


def report(m: dict, rows: list[dict]) -> str:
    def f(v, fmt="{:.3f}"):
        return "n/a" if v is None else fmt.format(v)

    w = m["success_wilson95"] or [None, None]
    lines = [f"# {m['policy']} on {m['task']} ({m['game_id']}), {m['interface']} actions", "",
             f"{m['episodes']} episodes, seeds {m['seed']}..{m['seed'] + m['episodes'] - 1}, step budget "
             f"{m['step_budget']} actions, page clock paused during inference: {m['pause_during_inference']} "
             f"({m['step_ms']} ms of page time per action).", "",
             "| metric | value |", "|---|---|",
             f"| success | {f(m['success_rate'])} (95% Wilson {f(w[0])}-{f(w[1])}) |",
             f"| progress | {f(m['progress'])} |",
             f"| mean steps | {f(m['mean_steps'], '{:.2f}')} |",
             f"| invalid actions (no tool call / out of space) | {m['invalid_action_rate']:.3f} "
             f"({m['no_tool_call_rate']:.3f} / {m['out_of_space_rate']:.3f}) of {m['actions']} |",
             f"| environment failures (left out of success) | {m['env_failures']} |",
             f"| resets on fail | {m['resets_on_fail']} |",
             f"| mean policy time per action | {f(m['mean_think_s'], '{:.3f}')} s |",
             f"| outcomes | {', '.join(f'{k}: {v}' for k, v in m['outcomes'].items())} |", "", "## Episodes", ""]
    for i, r in enumerate(rows[:5]):
        lines.append(f"- seed {r['seed']}: \"{r['instruction']}\": {r['outcome']} in {r['steps']} steps"
                     + (f" (strip: strip_{i}.png)" if i < 3 else ""))
        for a in r["actions"][:6]:
            lines.append(f"  - {json.dumps(a['action'])} -> {a['invalid'] or a['status']}")
    return "\n".join(lines) + "\n"
