"""SFT: the tiny student's tokenizer and template, TRL's tokenization and assistant mask, a few real training
steps, resume, and the checkpoint running in the sandbox through batched generation."""

from __future__ import annotations

import json

import pytest

from agent.parser import ToolCall, parse_text, render_compact
from sft.student import StudentConfig, build_tiny_student, corpus_texts, n_params, train_tokenizer
from sft.train import SFTSection, load_sft_dataset, run_sft

SMALL = StudentConfig(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=2, num_kv_heads=1,
                      vocab_size=600)


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory, built_tasks):
    """TEMP: the step/conversation artifact built here until distill/ lands."""
    import hashlib
    from datasets import Dataset, Features, Json, List, Value
    from agent.clients import ScriptedExpertClient
    from agent.tools import tool_definitions
    from evaluation.policies import ModelPolicy
    from evaluation.sandbox_eval import run_episode
    from sandbox.gym_env import SandboxEnv
    out = tmp_path_factory.mktemp("ds")
    env = SandboxEnv()
    pol = ModelPolicy(ScriptedExpertClient(env), name="expert")
    msg = {"role": Value("string"), "content": Value("string"),
           "tool_calls": List({"id": Value("string"), "type": Value("string"),
                               "function": {"name": Value("string"), "arguments": Json()}}),
           "tool_call_id": Value("string"), "name": Value("string")}
    feats = Features({"messages": List(msg), "tools": Json(), "instruction_id": Value("string")})
    steps, convs = [], []
    blank = {"tool_calls": None, "tool_call_id": None, "name": None}
    for i, t in enumerate([t for t in built_tasks if t.split == "train"]):
        tr = run_episode(env, t, pol, seed=i)
        conv = [{**blank, **m} for m in tr.turns[0].prompt]
        for k, u in enumerate(tr.turns):
            a = {**blank, "role": "assistant", "content": u.reasoning,
                 "tool_calls": [{"id": f"call_{k}", "type": "function",
                                 "function": {"name": u.tool_call["name"], "arguments": u.tool_call["arguments"]}}]}
            steps.append({"messages": [{**blank, **m} for m in u.prompt] + [a], "tools": tool_definitions(),
                          "instruction_id": t.instruction_id})
            conv += [a, {**blank, "role": "tool", "content": u.observation, "tool_call_id": f"call_{k}",
                         "name": u.tool_call["name"]}]
        convs.append({"messages": conv[:-1], "tools": tool_definitions(), "instruction_id": t.instruction_id})
    for name, rows in (("step", steps), ("conversation", convs)):
        (out / "data" / name).mkdir(parents=True)
        val = [r for r in rows if int(hashlib.md5(r["instruction_id"].encode()).hexdigest(), 16) % 10 == 0]
        tr_ = [r for r in rows if r not in val]
        Dataset.from_list(tr_, features=feats).to_parquet(str(out / "data" / name / "train-00000-of-00001.parquet"))
        Dataset.from_list(val, features=feats).to_parquet(str(out / "data" / name /
                                                               "validation-00000-of-00001.parquet"))
    cfg = "".join(f"- config_name: {n}\n  data_files:\n  - split: train\n    path: data/{n}/train-*\n"
                  f"  - split: validation\n    path: data/{n}/validation-*\n" for n in ("step", "conversation"))
    (out / "README.md").write_text("---\nconfigs:\n" + cfg + "---\n# temp\n")
    return out


@pytest.fixture(scope="module")
def step_rows(sft_dataset):
    return list(load_sft_dataset(sft_dataset, "step")["train"])


@pytest.fixture(scope="module")
def tok(step_rows):
    return train_tokenizer(corpus_texts(step_rows), SMALL.vocab_size)


def _gold(row) -> dict:
    fn = row["messages"][-1]["tool_calls"][0]["function"]
    return {"name": fn["name"], "arguments": {k: v for k, v in fn["arguments"].items() if v is not None}}


def test_compact_rendering_round_trips_every_teacher_call(step_rows, tok):
    for row in step_rows:
        gold = _gold(row)
        text = tok.apply_chat_template(row["messages"], tokenize=False)
        body = text.rsplit("<|assistant|>", 1)[1]
        assert body.startswith("<tool_call>") and body.endswith("</tool_call><|end|>")
        parsed = parse_text(body.replace("<|end|>", ""))
        assert isinstance(parsed, ToolCall) and parsed.as_dict() == gold, (body, gold)
        assert body == f"<tool_call>{render_compact(gold['name'], gold['arguments'])}</tool_call><|end|>"


def test_trl_tokenizes_the_dataset_and_masks_exactly_the_assistant_tokens(sft_dataset, tok, tmp_path):
    from trl import SFTConfig, SFTTrainer
    ds = load_sft_dataset(sft_dataset, "step")
    model = build_tiny_student(SMALL, tok)
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, max_length=2048, report_to=[],
                     use_cpu=True, max_steps=1)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds["train"].select(range(40)),
                         processing_class=tok)
    rows = ds["train"].select(range(40))
    for row, enc in zip(rows, trainer.train_dataset, strict=True):
        prompt = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_dict=True,
                                         tools=row["tools"])["input_ids"]
        ids = enc["input_ids"]
        mask = [int(lab != -100) for lab in enc["labels"]]  # TRL turns the assistant mask into labels
        assert ids[: len(prompt)] == prompt  # the prompt ends on <|assistant|>: no merge across the boundary
        assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]).endswith("</tool_call><|end|>")
    # the conversation config too: every assistant turn, and only those, is masked
    conv = load_sft_dataset(sft_dataset, "conversation")["train"].select(range(3))
    t2 = SFTTrainer(model=model, args=args, train_dataset=conv, processing_class=tok)
    for row, enc in zip(conv, t2.train_dataset, strict=True):
        text = tok.decode([i for i, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != -100])
        n_asst = sum(1 for m in row["messages"] if m["role"] == "assistant")
        assert text.count("<tool_call>") == n_asst and text.count("<|end|>") == n_asst
        assert "<|tool|>" not in text and "<|user|>" not in text


def test_a_few_sft_steps_lower_the_loss_and_resume(sft_dataset, tmp_path):
    cfg = SFTSection(student=SMALL, max_steps=12, batch_size=8, lr=1e-2, eval_steps=6, save_steps=6,
                     logging_steps=2, max_eval_samples=16, warmup_ratio=0.0, scheduler="constant_with_warmup")
    m = run_sft(cfg, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    losses = [c["loss"] for c in m["curve"] if "loss" in c]
    assert len(losses) >= 5 and losses[-1] < losses[0] * 0.8
    assert m["steps"] == 12 and not m["resumed"] and (tmp_path / "sft" / "final" / "config.json").is_file()
    assert 20_000 < m["params"] < 200_000
    # resume: a longer schedule continues from the last checkpoint instead of starting over
    m2 = run_sft(cfg.model_copy(update={"max_steps": 14}), sft_dataset, tmp_path / "sft", seed=0,
                 show_progress=False)
    assert m2["resumed"] and m2["steps"] == 14
    saved = json.loads((tmp_path / "sft" / "metrics.json").read_text())
    assert saved["steps"] == 14


def test_checkpoint_runs_in_the_sandbox_batched_like_sequential(sft_dataset, tmp_path, built_tasks):
    from agent.clients import TransformersClient
    from evaluation.policies import ModelPolicy
    from evaluation.sandbox_eval import evaluate, run_episode, run_model_batched
    from sandbox.gym_env import SandboxEnv
    cfg = SFTSection(student=SMALL, max_steps=4, batch_size=8, eval_steps=4, save_steps=4, logging_steps=2,
                     max_eval_samples=8)
    final = tmp_path / "sft" / "final"
    run_sft(cfg, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    tasks = [t for t in built_tasks if t.split == "test"][:3]
    tasks = [t.model_copy(update={"step_budget": 4}) for t in tasks]  # an untrained model runs to the budget
    client = TransformersClient(final, max_new_tokens=24, batch_size=4)
    batched = run_model_batched(tasks, client, seeds=[0, 1, 2], batch_size=3)
    seq = [run_episode(SandboxEnv(), t, ModelPolicy(client), seed=i) for i, t in enumerate(tasks)]
    assert [[u.raw_output for u in tr.turns] for tr in batched] == [[u.raw_output for u in tr.turns] for tr in seq]
    assert all(u.prompt and u.prompt[-1]["role"] == "user" for tr in batched for u in tr.turns)
    metrics, _ = evaluate(tasks, str(final), batch_size=2)
    assert set(metrics) >= {"easy", "medium", "hard", "all"} and "invalid_action_rate" in metrics["all"]


def test_tiny_student_size_follows_the_recipe(tok):
    model = build_tiny_student(StudentConfig(), tok)
    assert 1_000_000 < n_params(model) < 3_000_000
    assert model.config.tie_word_embeddings and model.config.eos_token_id == tok.eos_token_id
