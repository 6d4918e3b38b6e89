"""SFT: the tiny student's tokenizer and template, TRL's tokenization and assistant mask, a few real training
steps, resume, and the checkpoint running in the sandbox through batched generation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent.parser import ToolCall, parse_text, render_compact
from sft.student import StudentConfig, build_tiny_student, corpus_texts, n_params, train_tokenizer
from sft.train import SFTSection, load_sft_dataset, run_sft

ROOT = Path(__file__).resolve().parents[1]
SMALL = StudentConfig(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=2, num_kv_heads=1,
                      vocab_size=600)


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory):
    """The tiny recipe's real distillation artifact (expert teacher, rule judge, parquet + card)."""
    from pipeline.recipe import load_recipe
    from pipeline.stages import run_distill_stage
    out = tmp_path_factory.mktemp("distill")
    recipe = load_recipe(ROOT / "recipes" / "ci.yaml")
    run_distill_stage(recipe.model_copy(update={"distill": recipe.distill.model_copy(
        update={"validation_fraction": 0.15})}), out, show_progress=False)
    return out / "dataset"


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


def test_an_id_is_one_and_the_same_token_in_lists_brackets_and_calls(step_rows, tok):
    """ " ball_2" in a list, "[ball_2]" in an observation, "navigate(room_0_1)" in the memory and the compact call
    all carry an id as the same tokens (a frequent id with numbers is one token, an id made of words one token per
    word), so copying an id is copying those tokens."""
    def contains(tokens: list[str], part: list[str]) -> bool:
        return any(tokens[i: i + len(part)] == part for i in range(len(tokens)))

    row = next(r for r in step_rows if "[" in r["messages"][1]["content"])
    oid = row["messages"][1]["content"].split("[", 1)[1].split("]", 1)[0]
    part = tok.tokenize(" " + oid)
    for text in (f"You see: a thing [{oid}].", f"Objects: thing {oid} at here", f"- navigate({oid}) -> ok"):
        assert contains(tok.tokenize(text), part), (text, tok.tokenize(text), part)
    call = tok.apply_chat_template(row["messages"][:2] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "pick_up", "arguments": {"object": oid}}}]}], tokenize=False)
    assert contains(tok.tokenize(call.rsplit("<|assistant|>", 1)[1]), part)


def test_an_object_is_the_same_tokens_in_the_instruction_the_lists_and_the_calls(step_rows, tok):
    """An id made of words is split at its words (` yellow` + `_key`), ids with numbers stay whole, and the
    instruction's prose name reads as the id: "go to the yellow key" carries the very tokens of `yellow_key` in
    lists and calls. A compact call's later argument is tokenized as the first one is."""
    from sft.student import object_names

    def at(tokens: list[str], part: list[str]) -> int:
        return next(i for i in range(len(tokens)) if tokens[i: i + len(part)] == part)  # StopIteration: absent

    names = object_names(corpus_texts(step_rows))
    assert names and all(oid == name.replace(" ", "_") for name, oid in names.items())
    name, oid = next(iter(names.items()))
    part = tok.tokenize(" " + oid)
    for text in (f"Go to the {name}.", f"Objects: {oid} at room_0_1", f"You see: {name} [{oid}_2].",
                 f"<tool_call>place thing_1|{oid}</tool_call>", f"- navigate({oid}) -> ok"):
        tokens = tok.tokenize(text)
        i = at(tokens, part)
        assert tokens[i - 1] != "_" and tok.convert_tokens_to_string(tokens[i:i + len(part)]) == " " + oid
    assert tok.decode(tok(f"Go to the {name}.")["input_ids"]) == f"Go to the {oid}."  # what the model reads
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(
        " yellow_key_2 kitchen_counter_top room_0_1 charger_1 blue_door_room_0_2_room_1_2")]
    assert pieces == ["Ġyellow", "_key_2", "Ġkitchen", "_counter", "_top", "Ġroom_0_1", "Ġcharger_1",
                      "Ġblue_door_room_0_2_room_1_2"]
    for text in ("navigate yellow_key_2", "Objects: kitchen_counter at kitchen; charger_1 at room_0_1"):
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.decode(tok("place purple_box|yellow_key")["input_ids"]) == "place purple_box| yellow_key"
    assert object_names(["a red ball [red_ball_2], a lamp [lamp_1], door [door_room_0_1]"]) == {"red ball": "red_ball"}
    assert object_names(["a ball [red_ball] only as an id"]) == {}  # its prose name is never written


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


def test_skip_lines_leaves_those_lines_out_of_what_the_tiny_student_reads(step_rows):
    """`skip_lines`: the template renders the user message without the lines that start so, the rest unchanged
    and in order; the assistant turn and its mask are as before; a prefix that would break the template is
    refused."""
    rows = step_rows[:30]
    plain = train_tokenizer(corpus_texts(rows), SMALL.vocab_size)
    skipping = train_tokenizer(corpus_texts(rows), SMALL.vocab_size, skip_lines=["Places:", "Doors:"])
    dropped = 0
    for row in rows:
        full = plain.apply_chat_template(row["messages"], tokenize=False)
        short = skipping.apply_chat_template(row["messages"], tokenize=False)
        user = row["messages"][1]["content"]
        kept = "\n".join(line for line in user.split("\n") if not line.startswith(("Places:", "Doors:")))
        dropped += user.count("\n") - kept.count("\n")
        assert short == full.replace(user, kept) and "Places:" not in short
        enc = skipping.apply_chat_template(row["messages"], return_dict=True, return_assistant_tokens_mask=True)
        masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
        assert skipping.decode(masked).startswith("<tool_call>")
    assert dropped >= len(rows)  # every step prompt has a Places line
    for bad in ("", "it's", "a\nb"):
        with pytest.raises(ValueError, match="skip_lines"):
            train_tokenizer(corpus_texts(rows), SMALL.vocab_size, skip_lines=[bad])
        with pytest.raises(ValueError, match="skip_lines"):  # a recipe says so before any stage runs
            StudentConfig(skip_lines=[bad])
    with pytest.raises(ValueError, match="tiny"):
        StudentConfig(kind="pretrained", base="x", short_memory=True)


def test_short_memory_keeps_a_successful_steps_call_and_a_failed_steps_error(step_rows):
    """`short_memory`: a memory line of a step that succeeded reads `- call -> ok`; a failed step's line, and
    every other line, is as the prompt builder wrote it."""
    from agent.prompt import StepMemory
    memory = StepMemory()
    memory.add({"name": "navigate", "arguments": {"target": "room_0_1"}}, None, "You are in the north room "
               "[room_0_1]. You see: red ball [red_ball].")
    memory.add({"name": "navigate", "arguments": {"target": "room_1_1"}}, "trigger_fired",
               "The way from the north room to the centre room is blocked.")
    row = next(r for r in step_rows if "Recent:" in r["messages"][1]["content"])
    user = row["messages"][1]["content"]
    head, tail = user.split("Recent:\n", 1)
    tail = tail.split("\nObservation:", 1)[1]
    recent = "\n".join(f"- {c} -> {r}" for c, r in memory.steps)
    messages = [row["messages"][0], {"role": "user", "content": f"{head}Recent:\n{recent}\nObservation:{tail}"}]
    tok = train_tokenizer(corpus_texts(step_rows[:30]), SMALL.vocab_size, short_memory=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "- navigate(room_0_1) -> ok\n" in text and "You see: red ball" not in text.split("Observation:")[0]
    assert "- navigate(room_1_1) -> trigger_fired: The way from the north room to the centre room is blocked" \
        in text
    assert text.replace("- navigate(room_0_1) -> ok\n", "") == \
        tok.apply_chat_template([messages[0], {"role": "user", "content": messages[1]["content"].replace(
            "- " + "navigate(room_0_1) -> " + memory.steps[0][1] + "\n", "")}], tokenize=False,
            add_generation_prompt=True)


def test_bf16_autocast_trains_on_cpu(sft_dataset, tmp_path):
    """`bf16: true` trains in bf16 autocast on the CPU too (weights stay float32) and the loss falls."""
    cfg = SFTSection(student=SMALL, max_steps=8, batch_size=8, lr=1e-2, eval_steps=8, save_steps=8,
                     logging_steps=2, max_eval_samples=8, warmup_ratio=0.0, bf16=True)
    m = run_sft(cfg, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    losses = [c["loss"] for c in m["curve"] if "loss" in c]
    assert losses[-1] < losses[0]
    assert m["bf16"] is True
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "sft" / "final" / "model.safetensors")
    assert {str(w.dtype) for w in weights.values()} == {"torch.float32"}


def test_bf16_auto_is_bf16_only_where_native(monkeypatch):
    """`bf16: auto` (the recipes' setting) trains in bf16 only where the machine computes it natively; an explicit
    `true` on an emulating CPU still trains in bf16 but warns; anything else is rejected, naming the key."""
    import sft.train as st
    assert SFTSection(bf16="auto").bf16 == "auto"
    with pytest.raises(ValueError, match="bf16"):
        SFTSection(bf16="fast")
    for native in (True, False):
        monkeypatch.setattr(st, "native_bf16", lambda native=native: native)
        assert st.use_bf16("auto") is native
        assert st.use_bf16(False) is False
    with pytest.warns(UserWarning, match="emulated"):
        assert st.use_bf16(True) is True


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
    from agent.episode import play
    from agent.policies import ChatPolicy
    from evaluation.sandbox_eval import evaluate
    from sandbox.gym_env import SandboxEnv
    cfg = SFTSection(student=SMALL, max_steps=4, batch_size=8, eval_steps=4, save_steps=4, logging_steps=2,
                     max_eval_samples=8)
    final = tmp_path / "sft" / "final"
    run_sft(cfg, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    tasks = [t for t in built_tasks if t.split == "test"][:3]
    tasks = [t.model_copy(update={"step_budget": 4}) for t in tasks]  # an untrained model runs to the budget
    client = TransformersClient(final, max_new_tokens=24, batch_size=4)
    starts = [({"task": t}, i) for i, t in enumerate(tasks)]
    batched = play(SandboxEnv, ChatPolicy(client), starts, batch_size=3).trajectories
    seq = play(SandboxEnv, ChatPolicy(client), starts, batch_size=1).trajectories
    assert [[u.raw_output for u in tr.turns] for tr in batched] == [[u.raw_output for u in tr.turns] for tr in seq]
    assert all(u.prompt and u.prompt[-1]["role"] == "user" for tr in batched for u in tr.turns)
    metrics, _ = evaluate(tasks, str(final), batch_size=2)
    assert set(metrics) >= {"easy", "medium", "hard", "all"} and "invalid_action_rate" in metrics["all"]
    # constrained, the barely trained student's every turn is a readable call of a real skill
    _, trajs = evaluate(tasks, str(final), batch_size=2, constrained=True)
    assert all(u.error not in ("parse_error", "unknown_tool") for tr in trajs for u in tr.turns)
    assert all(u.tool_call is not None for tr in trajs for u in tr.turns)


def test_tiny_student_size_follows_the_recipe(tok):
    model = build_tiny_student(StudentConfig(), tok)
    assert 1_000_000 < n_params(model) < 3_000_000
    assert model.config.tie_word_embeddings and model.config.eos_token_id == tok.eos_token_id


def _qwen_like_base(out: Path, rows) -> Path:
    """A local stand-in for a Qwen2.5 instruct checkpoint: a Qwen2-architecture model and a tokenizer with
    Qwen2.5's own chat template (the copy TRL ships) and its special tokens, saved with save_pretrained.
    Loading it goes through exactly the code that loads `Qwen/Qwen2.5-0.5B-Instruct` from the Hub."""
    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for r in rows for m in r["messages"] if m["content"]]
    texts += [json.dumps(tc["function"]) for r in rows for m in r["messages"] for tc in m["tool_calls"] or []]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=800, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    conf = Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                       eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    Qwen2ForCausalLM(conf).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def test_pretrained_student_keeps_its_template_and_trains_lora(sft_dataset, step_rows, tmp_path):
    from trl import SFTConfig, SFTTrainer

    from agent.clients import TransformersClient
    from sft.student import load_pretrained_student, lora_config
    base = _qwen_like_base(tmp_path / "qwen-like", step_rows[:200])
    cfg = StudentConfig(kind="pretrained", base=str(base), lora_r=8, lora_alpha=16)
    model, tok = load_pretrained_student(cfg)
    ds = load_sft_dataset(sft_dataset, "step")
    args = SFTConfig(output_dir=str(tmp_path / "x"), assistant_only_loss=True, max_length=4096, report_to=[],
                     use_cpu=True, max_steps=1)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds["train"].select(range(8)), processing_class=tok,
                         peft_config=lora_config(cfg))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert 0 < trainable < 0.2 * sum(p.numel() for p in trainer.model.parameters())  # LoRA adapters only
    for row, enc in zip(ds["train"].select(range(8)), trainer.train_dataset, strict=True):
        text = tok.decode([i for i, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != -100])
        fn = row["messages"][-1]["tool_calls"][0]["function"]
        # Qwen2.5's own rendering: the thought, JSON inside <tool_call>, then <|im_end|>; nothing of the prompt
        assert text.strip().startswith(row["messages"][-1]["content"].strip()), text
        assert "<tool_call>\n{" in text and text.rstrip().endswith("</tool_call><|im_end|>"), text
        assert "<|im_start|>" not in text
        parsed = parse_text(text.replace("<|im_end|>", ""))
        assert isinstance(parsed, ToolCall) and parsed.name == fn["name"]
    # the stage: LoRA training, merged into a plain checkpoint that the evaluation client loads
    sft = SFTSection(student=cfg, max_steps=10, batch_size=4, lr=1e-2, eval_steps=5, save_steps=5,
                     logging_steps=2, max_eval_samples=8, max_train_samples=64, warmup_ratio=0.0,
                     scheduler="constant_with_warmup")
    m = run_sft(sft, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    losses = [c["loss"] for c in m["curve"] if "loss" in c]
    assert losses[-1] < losses[0] and m["trainable_params"] < m["params"]
    final = tmp_path / "sft" / "final"
    assert (final / "config.json").is_file() and not (final / "adapter_config.json").exists()
    client = TransformersClient(final, max_new_tokens=8)
    row = step_rows[0]
    prompt = client.render_prompt(row["messages"][:-1], row["tools"])
    assert prompt.startswith("<|im_start|>system\n") and '"name": "navigate"' in prompt  # tools in the system turn
    assert prompt.endswith("Next skill call?<|im_end|>\n<|im_start|>assistant\n")
    assert isinstance(client.chat(row["messages"][:-1], tools=row["tools"]).text, str)


def test_packing_and_offline_wandb_logging(sft_dataset, tmp_path, monkeypatch):
    """Packed batches (TRL's best-fit decreasing, padding-free) train too, and `sft.wandb: true` logs a real
    wandb run, offline when no API key is configured."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = SFTSection(student=SMALL, max_steps=6, batch_size=4, lr=1e-2, eval_steps=6, save_steps=6,
                     logging_steps=2, max_eval_samples=8, warmup_ratio=0.0, packing=True, max_length=2048,
                     wandb=True, scheduler="constant_with_warmup")
    m = run_sft(cfg, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    losses = [c["loss"] for c in m["curve"] if "loss" in c]
    assert m["steps"] == 6 and losses[-1] < losses[0]
    runs = list((tmp_path / "sft" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_language_modelling_phase_then_assistant_only(sft_dataset, tmp_path):
    """`lm_epochs`: a from-scratch student first learns its prompts with loss on every token, then the
    assistant-only phase starts from those weights; a rerun reuses the finished first phase."""
    cfg = SFTSection(student=SMALL.model_copy(update={"reasoning": True}), lm_epochs=0.3, max_steps=6,
                     batch_size=8, lr=1e-2, eval_steps=6, save_steps=6, logging_steps=2, max_eval_samples=8,
                     warmup_ratio=0.0)
    m = run_sft(cfg, sft_dataset, tmp_path / "sft", seed=0, show_progress=False)
    lm = m["lm_phase"]
    assert lm["loss"] == "all_tokens" and m["loss"] == "assistant_only" and lm["steps"] > 0
    lm_losses = [c["loss"] for c in lm["curve"] if "loss" in c]
    assert lm_losses[-1] < lm_losses[0]
    assert (tmp_path / "sft" / "lm" / "final" / "config.json").is_file()
    # the phases differ in what they label: every token, or only the assistant's
    from safetensors.torch import load_file
    init = load_file(tmp_path / "sft" / "student_init" / "model.safetensors")
    after_lm = load_file(tmp_path / "sft" / "lm" / "final" / "model.safetensors")
    assert any(not init[k].equal(after_lm[k]) for k in init)
    again = run_sft(cfg.model_copy(update={"max_steps": 8}), sft_dataset, tmp_path / "sft", seed=0,
                    show_progress=False)
    assert again["lm_phase"] == lm and again["resumed"] and again["steps"] == 8
    with pytest.raises(ValueError, match="lm_epochs"):
        SFTSection(student=StudentConfig(kind="pretrained", base="x"), lm_epochs=1.0)


def test_sft_cli_runs_the_distillation_first_when_its_dataset_is_missing(tmp_path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "sft", str(ROOT / "recipes" / "ci.yaml"), "--quiet"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "running `embodistill distill` first" in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["steps"] == 4 and out["params"] < 200_000
    assert (tmp_path / "outputs" / "ci" / "distill" / "dataset" / "README.md").is_file()
    assert (tmp_path / "outputs" / "ci" / "sft" / "final" / "config.json").is_file()
    bad = subprocess.run([sys.executable, "-m", "pipeline.cli", "sft", str(ROOT / "recipes" / "ci.yaml"), "--dataset",
                          str(tmp_path / "nowhere"), "--quiet"], capture_output=True, text=True, cwd=tmp_path,
                         env=env)
    assert bad.returncode == 2 and "run `embodistill distill` first" in bad.stderr


def test_constrained_decoding_admits_every_teacher_call_and_only_ids_the_prompt_shows(step_rows, tok):
    """Replaying the tiny template's rendering of each teacher call token by token through `CallConstraint`:
    every token is allowed and the call ends where the end token is allowed; a call naming an id that its prompt
    does not list as known (a word of the task's prose, of an echoed error, a label, a thing not seen yet), a
    skill that does not exist, a missing required argument, a walk to where the agent stands or the repeat of a
    one-id call that failed since the last call that worked is cut at the first token that goes wrong."""
    from agent.constrained import CallConstraint, _State
    from agent.tools import tool_definitions
    cc = CallConstraint(tok)

    def replay(prompt_text: str, body: str, tools=None) -> bool:
        ids = cc.ids_trie(prompt_text, tools)
        st = _State(0)
        for t in tok(f"<tool_call>{body}</tool_call>", add_special_tokens=False)["input_ids"]:
            if t not in cc.allowed(st, ids):
                return False
            st = cc.step(st, t, ids)
        return set(cc.allowed(st, ids)) == cc.end_ids

    checked = 0
    for r in step_rows[:300]:
        prompt = tok.apply_chat_template(r["messages"][:2], add_generation_prompt=True, tokenize=False)
        gold = _gold(r)
        assert replay(prompt, render_compact(gold["name"], gold["arguments"])), (gold, prompt[-300:])
        checked += 1
    assert checked == 300
    prompt = ("At: room_0_1. Holding: nothing.\nObjects: red_box at room_0_1; yellow_ball at room_1_1\nRecent:\n"
              "- navigate(room_2_2) -> ok\n- pick_up(red) -> unknown_entity: I know no 'red' here or anywhere I "
              "have been.\nTask objects: red_box at room_0_1 (here); purple key not seen\n"
              "Task: Put the red box next to the yellow box, then find the purple key.")
    assert replay(prompt, "place red_box|yellow_ball") and replay(prompt, "navigate room_1_1")
    assert replay(prompt, "navigate room_2_2")               # a recent call that worked named it
    assert not replay(prompt, "navigate room_0_1")           # where the agent is already
    assert replay(prompt, "place red_box|room_0_1")          # ... which other skills may name
    for junk in ("red", "been", "Objects", "nothing", "purple", "Put", "box"):   # prose, labels, not seen
        assert not replay(prompt, f"pick_up {junk}"), junk
    assert not replay(prompt, "place red_box|yellow_box")     # yellow_box: words of the prompt, not an id in it
    assert not replay(prompt, "fly room_1_1")                 # no such skill
    assert not replay(prompt, "place red_box")                # place needs its target
    assert replay(prompt, "finish") and replay(prompt, "finish the box is placed")   # summary: optional text
    # a one-id call that failed since the last call that worked is not written again (a failed call changes
    # nothing, so it would fail the same way), unless a sandbox failure trigger fired (it may not fire again)
    failed = prompt.replace("pick_up(red) -> unknown_entity", "pick_up(red_box) -> precondition_unmet")
    assert not replay(failed, "pick_up red_box") and replay(prompt, "pick_up red_box")
    assert replay(failed, "pick_up yellow_ball") and replay(failed, "inspect red_box")
    assert replay(failed.replace("precondition_unmet", "trigger_fired"), "pick_up red_box")
    two = failed.replace("\nTask objects:", "\n- pick_up(yellow_ball) -> unknown_entity: I know no.\nTask objects:")
    assert not replay(two, "pick_up red_box") and not replay(two, "pick_up yellow_ball")
    assert replay(two.replace("pick_up(yellow_ball)", "look_around()").replace("-> unknown_entity", "-> ok"),
                  "pick_up red_box")                      # a call worked since: the state may have changed
    walked = two.replace("pick_up(yellow_ball)", "navigate(room_1_1)")
    assert not replay(walked, "navigate room_1_1") and replay(walked, "navigate room_2_2")
    assert replay(walked, "pick_up red_box")              # a walk that failed may have moved the agent first
    # a skill with no id left for its first argument cannot even be started (no call without its argument)
    alone = "At: room_0_1. Holding: nothing.\nRecent:\n- pick_up(room_0_1) -> unknown_entity: no.\nTask: Look."
    ids = cc.ids_trie(alone)
    opened = cc.step(_State(0), cc.open_id, ids)
    assert not any(cc.text.get(t, "").startswith("pi") for t in cc.allowed(opened, ids))   # no `pick...` token
    assert not replay(alone, "navigate room_0_1") and replay(alone, "look_around")
    starts = [cc.text.get(t, "") for t in cc.allowed(opened, ids)]     # a place is no thing: no `inspect` either
    assert any(x and "look_around".startswith(x) for x in starts)
    assert not any(x and ("inspect".startswith(x) or x.startswith("inspect")) for x in starts)
    # an argument that is an object, a door, a device or a person never names a place: not the room the agent is
    # at, a room it knows, an unvisited exit or the rooms a door joins; a place's own arguments still may
    typed = ("At: hall. Holding: red_key.\nPlaces: hall [desk], dish_pit dish pit\nDoors: gate closed "
             "(hall-dish_pit)\nUnvisited: hall_east\nObjects: red_key held; mug at hall desk\nTask: Go.")
    for call in ("pick_up hall_east", "pick_up dish_pit", "pick_up dish", "open hall-dish_pit", "inspect hall",
                 "close hall_east", "place dish_pit|hall"):
        assert not replay(typed, call), call
    for call in ("pick_up mug", "open gate", "open desk", "inspect gate", "navigate hall_east", "navigate dish_pit",
                 "navigate mug", "place red_key|hall", "place red_key|desk"):
        assert replay(typed, call), call
    # an enum's values are the tools' (TextWorld's operate takes eat, cook, lock, ...; the sandbox's turn_on/off)
    tw_tools = tool_definitions(("eat", "cook", "lock"))
    assert replay(prompt, "operate red_box|turn_on") and not replay(prompt, "operate red_box|lock")
    assert replay(prompt, "operate red_box|lock", tw_tools) and not replay(prompt, "operate red_box|turn_on", tw_tools)
    # a student trained to think first may write text before the call, only then
    ids, words = cc.ids_trie(prompt), tok(" I will go", add_special_tokens=False)["input_ids"]
    assert words[0] not in cc.allowed(_State(0), ids)
    assert words[0] in CallConstraint(tok, think=True).allowed(_State(0), ids)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    word_level = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    plain = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="a")
    with pytest.raises(ValueError, match="single tokens"):
        CallConstraint(plain)


def test_constrained_generation_writes_valid_calls_even_untrained(tok, tmp_path):
    """An untrained student writes noise; constrained, each of its replies parses to a real skill whose id
    arguments are ids its prompt lists as known, and never walks to where it is (real `generate`, batched,
    greedy and sampled)."""
    from agent.clients import TransformersClient
    from agent.prompt import known_ids
    from sandbox.skills import SKILLS
    model = build_tiny_student(SMALL, tok)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    prompts = [[{"role": "system", "content": "You are an embodied assistant."},
                {"role": "user", "content": f"Step 1/9.\nAt: room_{i}_1.\nObjects: red_box at room_0_{i}\n"
                                            "Task: Go to the box."}] for i in range(3)]
    free = TransformersClient(tmp_path / "m", max_new_tokens=12, batch_size=3)
    assert not all(isinstance(parse_text(r.text), ToolCall) for r in free.chat_many(prompts))
    for temperature in (0.0, 1.0):
        client = TransformersClient(tmp_path / "m", max_new_tokens=40, batch_size=3, constrained=True,
                                    temperature=temperature)
        for msgs, reply in zip(prompts, client.chat_many(prompts), strict=True):
            call = parse_text(reply.text)
            assert isinstance(call, ToolCall) and call.name in SKILLS, reply.text
            i = prompts.index(msgs)
            ids, here = known_ids(client.render_prompt(msgs))
            assert ids == {f"room_{i}_1", "red_box", f"room_0_{i}"} and here == f"room_{i}_1"
            for p in SKILLS[call.name].params:
                if p.description.startswith("id") and not p.enum and call.arguments.get(p.name):
                    assert call.arguments[p.name] in ids, (reply.text, p.name)
            assert call.name != "navigate" or call.arguments["target"] != here, reply.text


def test_constrained_rows_of_one_batch_each_keep_their_own_ids(tok):
    """In one batch, row 0 may name `red_box` and row 1 may not (its prompt never showed it), even at the same
    point of the call (right after `navigate`, where the next token carries the space and the id's first word)."""
    import torch

    from agent.constrained import CallConstraint
    cc = CallConstraint(tok)
    prompts = ["Objects: red_box at room_0_1. Task: Go to the box.", "Objects: grey_key at room_0_1. Task: Go."]
    proc = cc.processor(prompts, width=0)
    gen = tok("<tool_call>navigate", add_special_tokens=False)["input_ids"]
    first = tok(" red_box", add_special_tokens=False)["input_ids"][0]
    for _ in range(2):  # twice: the second call answers from the memo
        mask = proc(torch.tensor([gen, gen]), torch.zeros(2, len(tok)))
        assert mask[0, first] == 0 and mask[1, first] == float("-inf")
        room = tok(" room_0_1", add_special_tokens=False)["input_ids"][0]
        assert mask[0, room] == 0 and mask[1, room] == 0


def test_loading_an_artifact_leaves_no_copy_in_the_datasets_cache(sft_dataset, tok, tmp_path, monkeypatch):
    """`load_dataset(folder)` alone writes an Arrow copy of every artifact it reads to the user's cache, forever;
    ours reads through a temporary cache, and the rows stay usable (TRL maps them) once it is gone."""
    import datasets
    from trl import SFTConfig, SFTTrainer
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    ds = load_sft_dataset(sft_dataset, "step")
    assert not cache.exists() or not any(cache.rglob("*.arrow"))
    assert len(ds["train"]) > 40 and not ds["train"].cache_files
    args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, max_length=2048, report_to=[],
                     use_cpu=True, max_steps=1)
    trainer = SFTTrainer(model=build_tiny_student(SMALL, tok), args=args, train_dataset=ds["train"].select(range(8)),
                         processing_class=tok)
    assert len(trainer.train_dataset) == 8 and "input_ids" in trainer.train_dataset.column_names


def test_renamed_copies_keep_each_decision_under_made_up_names(step_rows):
    """A renamed copy of a row: the same skill, its id arguments renamed as the prompt's known ids are (so still
    ids the prompt shows), every name word gone from the prompt, directions, skills and the system message kept."""
    import random

    from agent.prompt import known_ids
    from sft.rename import _keep_words, name_words, renamed_row
    keep = _keep_words()
    renamed = 0
    for i, row in enumerate(step_rows[:120]):
        copy = renamed_row(row, random.Random(i), keep)
        (s0, u0, a0), (s1, u1, a1) = row["messages"], copy["messages"]
        assert s1 == s0 and copy["messages"] is not row["messages"]
        f0, f1 = a0["tool_calls"][0]["function"], a1["tool_calls"][0]["function"]
        assert f1["name"] == f0["name"] and f1["arguments"].keys() == f0["arguments"].keys()
        ids0, ids1 = known_ids(u0["content"])[0], known_ids(u1["content"])[0]
        assert len(ids1) == len(ids0)
        for k, v in f0["arguments"].items():
            if v in ids0:
                assert f1["arguments"][k] in ids1
        words = name_words(u0["content"], [str(v) for v in f0["arguments"].values()], keep)
        text1 = " " + " ".join(re.split(r"[^a-z0-9]+", u1["content"].lower())) + " "
        assert not [w for w in words if f" {w} " in text1]
        for d in ("north", "south", "east", "west", "Task:", "Next skill call?"):
            assert u1["content"].count(d) == u0["content"].count(d)
        renamed += bool(words) and u1 != u0
    assert renamed >= 100


def test_renamed_copies_are_added_after_the_tokenizer_and_drawn_by_seed(sft_dataset, tmp_path):
    from sft.rename import with_renamed_copies
    train = load_sft_dataset(sft_dataset, "step")["train"]
    a, b, c = (with_renamed_copies(train, 0.5, s) for s in (3, 3, 4))
    assert len(a) == len(train) + round(0.5 * len(train)) and a.features == train.features
    assert a[len(train):]["messages"] == b[len(train):]["messages"] != c[len(train):]["messages"]
    assert a[:len(train)]["messages"] == train["messages"]
    cfg = SFTSection(student=SMALL, max_steps=2, batch_size=8, eval_steps=2, save_steps=2, logging_steps=1,
                     max_eval_samples=8, renamed_copies=0.5)
    m = run_sft(cfg, sft_dataset, tmp_path / "sft", seed=3, show_progress=False)
    assert m["train_samples"] == len(a)
    # the made-up names are no tokens of the student's vocabulary: they are split into pieces, as new names are
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(tmp_path / "sft" / "final").get_vocab()
    made_up = {w for r in a[len(train):]["messages"] for w in re.findall(r"\b[a-z]{4,}\b", r[1]["content"])} \
        - {w for r in train["messages"] for w in re.findall(r"\b[a-z]{4,}\b", r[1]["content"])}
    assert len(made_up) > 50
    assert not [w for w in made_up if "Ġ" + w in vocab or w in vocab]
