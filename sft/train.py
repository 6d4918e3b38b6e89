"""Supervised fine-tuning with TRL's SFTTrainer: assistant-only loss, optional packing, an eval split, wandb
logging (offline unless configured), checkpoints and resume.

    from sft.train import SFTSection, run_sft
    run_sft(SFTSection(), dataset_dir="outputs/tiny/distill/dataset", out="outputs/tiny/sft", seed=0)

The dataset is the distillation artifact (parquet + card; `datasets.load_dataset(dir, config)`), in the
conversational format TRL takes as is (`messages` with `tool_calls`, `tool` results, and `tools`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.progress import StageBar
from agent.trajectory import write_json
from sft.rename import with_renamed_copies
from sft.student import (StudentConfig, build_tiny_student, corpus_texts, load_pretrained_student, lora_config,
                         n_params, train_tokenizer)


class SFTSection(BaseModel):
    """Recipe `sft:`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    student: StudentConfig = Field(default_factory=StudentConfig)
    epochs: float = Field(default=2.0, gt=0)
    max_steps: int = Field(default=-1, ge=-1)           # > 0 overrides epochs
    batch_size: int = Field(default=16, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    lr: float = Field(default=2e-3, gt=0, le=1.0)
    warmup_ratio: float = Field(default=0.03, ge=0, le=0.5)
    scheduler: Literal["cosine", "linear", "constant_with_warmup"] = "cosine"
    weight_decay: float = Field(default=0.0, ge=0)
    max_length: int = Field(default=4096, ge=32)   # tokens; a Hub model's template adds the tools JSON (~1-2k)
    packing: bool = False
    eval_steps: int = Field(default=200, ge=1)
    save_steps: int = Field(default=200, ge=1)
    logging_steps: int = Field(default=20, ge=1)
    max_eval_samples: int = Field(default=256, ge=1)
    max_train_samples: int | None = Field(default=None, ge=1)
    wandb: bool = False       # report to wandb (offline unless WANDB_MODE / WANDB_API_KEY say otherwise)
    threads: int | None = Field(default=None, ge=1)
    # bf16 autocast (weights and optimizer stay float32). On a GPU a pretrained student always trains so; on a CPU
    # with native bf16 (AVX512-BF16, AMX) a tiny student's step takes about 0.75x the float32 time, while on one
    # without (AVX2 only) bf16 is emulated and a step takes about 7x. "auto": bf16 where it is native (see
    # `use_bf16`), float32 elsewhere.
    bf16: bool | Literal["auto"] = False
    # A student built from scratch has never read anything. Before the assistant-only phase it can first learn
    # the language of its prompts: next-token loss on every token of the same training samples for this many
    # epochs (0 = off). Assistant-only loss alone labels a dozen of a sample's ~300 tokens; after this phase the
    # assistant-only loss starts far lower (measured: 0.84 instead of 6.0 after 25 steps).
    lm_epochs: float = Field(default=0.0, ge=0)
    lm_lr: float | None = Field(default=None, gt=0, le=1.0)   # default: lr
    # a renamed copy of this fraction of the training rows (`sft/rename.py`): the same decision with the things it is
    # about under made-up names, so that a name is copied from the prompt rather than learnt by heart (0 = off)
    renamed_copies: float = Field(default=0.0, ge=0, le=1.0)

    @model_validator(mode="after")
    def _lm_phase_for_tiny_only(self):
        if self.lm_epochs > 0 and self.student.kind != "tiny":
            raise ValueError("lm_epochs: the language-modelling phase is for students built from scratch (student.kind "
                             "tiny); a pretrained student already reads")
        return self


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively: a CUDA GPU, or a CPU whose oneDNN has bf16 kernels
    (AVX512-BF16 or AMX; an AVX2-only CPU emulates bf16, several times slower than float32)."""
    import torch
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def use_bf16(setting: bool | str) -> bool:
    """`sft.bf16` resolved for this machine: "auto" is bf16 where it is native; `true` where it is not still
    trains in bf16, with a warning that it is emulated (slow)."""
    if setting == "auto":
        return native_bf16()
    if setting and not native_bf16():
        import warnings
        warnings.warn("sft.bf16: true on a CPU without native bf16 (no AVX512-BF16 or AMX): autocast is emulated "
                      "and a step takes several times the float32 time; `bf16: auto` trains in float32 here",
                      stacklevel=2)
    return bool(setting)


class RightPaddedCausalCollator:
    """Drops the attention mask of right-padded batches. With causal attention a real token never attends to
    the pads after it, and pads carry no loss, so the mask changes nothing but forces SDPA off its fast
    causal kernel (about 2x slower per step on CPU). Batches that are not purely right-padded keep it."""

    def __init__(self, base):
        self.base = base

    def __call__(self, features):
        batch = self.base(features)
        mask = batch.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            lengths = mask.sum(dim=1)
            positions = mask.new_tensor(range(mask.shape[1])).unsqueeze(0)
            if bool(((positions < lengths.unsqueeze(1)).long() == mask).all()):
                del batch["attention_mask"]
                batch["position_ids"] = positions.expand(mask.shape[0], -1).contiguous()
        return batch


@contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for a block, then restore them (the caller's environment is not changed)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def labelled_positions_only():
    """Score only the positions that carry a label in TRL's fused LM head, on every device.

    TRL projects only the labelled positions through the LM head on Triton devices and every position elsewhere
    (fixed tile shapes for compilers such as Neuron's). On CPU nothing is compiled, and with assistant-only loss
    a step sample labels a dozen of its ~300 tokens, so scoring just those gives the same loss and gradients,
    23% faster per step (0.99 -> 0.76 s on the tiny student, measured side by side). If TRL renames the switch,
    training still runs, only slower."""
    import trl.trainer.utils as trl_utils
    original = getattr(trl_utils, "_use_triton", None)
    if original is None:
        yield
        return
    trl_utils._use_triton = lambda device: device.type != "meta"
    try:
        yield
    finally:
        trl_utils._use_triton = original


log = logging.getLogger(__name__)


def _progress_callback(bar: StageBar, phase: str):
    """A TrainerCallback that drives the stage's progress bar from the trainer's steps and sends the trainer's
    records (loss, learning rate, eval loss, ...) to this module's logger instead of printing them."""
    from transformers import TrainerCallback

    class StageProgress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            bar.phase(phase, state.max_steps, unit="step")
            bar.update(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            bar.update(1)

        def on_log(self, args, state, control, logs=None, **kwargs):
            log.info("%s step %d: %s", phase, state.global_step, json.dumps(logs or {}))
            if logs and "loss" in logs:
                bar.postfix(f"loss {float(logs['loss']):.4g}")

    return StageProgress()


def load_sft_dataset(dataset_dir: str | Path, config: str):
    """One config of a dataset artifact, train and validation, held in memory.

    `load_dataset` on a folder writes an Arrow copy of it to ~/.cache/huggingface/datasets, a new copy for every
    new artifact and never removed (5.5 GB after a day of runs here); the artifact's parquet is already the copy
    on disk, so the conversion goes to a temporary cache that is deleted once the rows are in memory."""
    from datasets import load_dataset
    dataset_dir = Path(dataset_dir)
    if not (dataset_dir / "README.md").is_file():
        raise FileNotFoundError(f"{dataset_dir}: no dataset card (README.md); run `embodistill distill` first")
    with tempfile.TemporaryDirectory(prefix="embodistill-datasets-") as cache:
        ds = load_dataset(str(dataset_dir), config, cache_dir=cache, keep_in_memory=True)
    for split in ("train", "validation"):
        if split not in ds:
            raise ValueError(f"{dataset_dir} config {config!r} has no {split} split")
    return ds


def make_student(cfg: StudentConfig, train_rows, seed: int):
    """(model, tokenizer, peft_config) for the recipe's student."""
    if cfg.kind == "tiny":
        tok = train_tokenizer(corpus_texts(train_rows), cfg.vocab_size, reasoning=cfg.reasoning,
                              name_tokens=cfg.name_tokens, skip_lines=cfg.skip_lines,
                              short_memory=cfg.short_memory)
        return build_tiny_student(cfg, tok, seed), tok, None
    model, tok = load_pretrained_student(cfg)
    return model, tok, lora_config(cfg)


def _train_phase(cfg: SFTSection, model, tok, peft_cfg, train, val, ckpt_dir: Path, seed: int, report: list,
                 wandb_env: dict, callbacks, bar: StageBar, assistant_only: bool):
    """One TRL SFTTrainer run (assistant-only loss, or every token for the language-modelling phase), resumed
    from its last checkpoint in `ckpt_dir`. Returns (trainer, metrics)."""
    import torch
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    epochs, lr = (cfg.epochs, cfg.lr) if assistant_only else (cfg.lm_epochs, cfg.lm_lr or cfg.lr)
    args = SFTConfig(
        output_dir=str(ckpt_dir), seed=seed, data_seed=seed, assistant_only_loss=assistant_only, packing=cfg.packing,
        max_length=cfg.max_length, num_train_epochs=epochs, max_steps=cfg.max_steps if assistant_only else -1,
        per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=lr, warmup_steps=cfg.warmup_ratio,
        lr_scheduler_type=cfg.scheduler, weight_decay=cfg.weight_decay, logging_steps=cfg.logging_steps,
        eval_strategy="steps", eval_steps=cfg.eval_steps, save_strategy="steps", save_steps=cfg.save_steps,
        save_total_limit=2, report_to=report, disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=use_bf16(cfg.bf16) or (torch.cuda.is_available() and cfg.student.kind != "tiny"),
        dataset_num_proc=None, remove_unused_columns=True, train_sampling_strategy="group_by_length",
        run_name=f"sft-{'assistant' if assistant_only else 'lm'}")
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=val, processing_class=tok,
                         peft_config=peft_cfg, callbacks=callbacks)
    # the stage's one progress bar and its log file, instead of the trainer's own bars and printed records
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(bar, "language modelling" if not assistant_only else "assistant-only"))
    if not cfg.packing:
        trainer.data_collator = RightPaddedCausalCollator(trainer.data_collator)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    resume = any(ckpt_dir.glob("checkpoint-*"))
    t0 = time.time()
    with labelled_positions_only(), _environ(wandb_env):
        result = trainer.train(resume_from_checkpoint=True if resume else None)
        train_s = time.time() - t0
        ev = trainer.evaluate()
    curve = [{k: r[k] for k in ("step", "loss", "eval_loss", "eval_mean_token_accuracy", "learning_rate")
              if k in r} for r in trainer.state.log_history]
    return trainer, {"loss": "assistant_only" if assistant_only else "all_tokens", "trainable_params": trainable,
                     "steps": trainer.state.global_step, "epochs": trainer.state.epoch,
                     "train_seconds": round(train_s, 1), "train_loss": result.training_loss,
                     "eval_loss": ev.get("eval_loss"), "eval_token_accuracy": ev.get("eval_mean_token_accuracy"),
                     "bf16": bool(args.bf16), "resumed": resume, "curve": curve}


def training_splits(dataset_dir: str | Path, config: str | Sequence[str], seed: int,
                    rows_per_config: dict[str, int] | None = None):
    """(train, validation) of one config, or of several joined on the columns they share (`messages`, `tools`).
    `rows_per_config` caps a config's train rows with a seeded sample (on-policy rounds: a sample of the
    teacher's rows beside every on-policy row)."""
    from datasets import concatenate_datasets
    configs = [config] if isinstance(config, str) else list(config)
    if len(configs) == 1 and not rows_per_config:
        ds = load_sft_dataset(dataset_dir, configs[0])
        return ds["train"], ds["validation"]
    trains, vals = [], []
    for c in configs:
        ds = load_sft_dataset(dataset_dir, c)
        train = ds["train"].select_columns(["messages", "tools"])
        cap = (rows_per_config or {}).get(c)
        if cap is not None and cap < len(train):
            train = train.shuffle(seed=seed).select(range(cap))
        trains.append(train)
        vals.append(ds["validation"].select_columns(["messages", "tools"]))
    return concatenate_datasets(trains), concatenate_datasets(vals).shuffle(seed=seed)


def save_final(model, tok, final: Path) -> None:
    """Write the student to `final` whole or not at all (a temp folder, then a rename): RL and evaluation take a
    final/ with config.json as a finished student."""
    staging = final.parent / f".{final.name}.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def run_sft(cfg: SFTSection, dataset_dir: str | Path, out: str | Path, seed: int = 0, show_progress: bool = True,
            callbacks=None, config: str | Sequence[str] = "step", bar: StageBar | None = None,
            init: str | Path | None = None, rows_per_config: dict[str, int] | None = None) -> dict:
    """Train the student on one dataset config (`step`: per-step prompts as RL shows them; `conversation`:
    whole multi-turn episodes), or on several joined (`training_splits`), and write OUT/final,
    OUT/checkpoints, OUT/metrics.json. `init`: continue from this student (a `save_pretrained` folder with its
    tokenizer; a pretrained student gets a fresh LoRA adapter) instead of building the recipe's student; the
    language-modelling phase is then skipped. Progress shows on `bar` (default: a bar of its own, when
    `show_progress`); the trainer's records go to this module's logger."""
    import torch
    from transformers import set_seed

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("manifest.json", "metrics.json"):   # an earlier run's results must not outlive a failed one
        (out / name).unlink(missing_ok=True)
    if (out / "final").is_dir():
        shutil.rmtree(out / "final")
    own_bar = bar is None
    bar = StageBar("sft", enabled=show_progress) if own_bar else bar
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_seed(seed)
    train, val = training_splits(dataset_dir, config, seed, rows_per_config)
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    val = val.select(range(min(cfg.max_eval_samples, len(val))))
    student_dir = out / "student_init"
    if init is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if not (Path(init) / "config.json").is_file():
            raise FileNotFoundError(f"{init}: no student there (no config.json) to continue training from")
        tok = AutoTokenizer.from_pretrained(init, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(init, local_files_only=True)
        peft_cfg = lora_config(cfg.student) if cfg.student.kind != "tiny" else None
    elif cfg.student.kind == "tiny" and (student_dir / "config.json").is_file():
        # resume: the tokenizer and initial weights were made by an earlier run of this stage
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(student_dir)
        model = AutoModelForCausalLM.from_pretrained(student_dir)
        peft_cfg = None
    else:
        model, tok, peft_cfg = make_student(cfg.student, train, seed)
        if cfg.student.kind == "tiny":
            model.save_pretrained(student_dir)
            tok.save_pretrained(student_dir)
    if cfg.renamed_copies:   # after the tokenizer: made-up names are split into pieces, as a new game's names are
        train = with_renamed_copies(train, cfg.renamed_copies, seed)
    report = []
    wandb_env = {}
    if cfg.wandb:  # offline unless the environment configures wandb; the run lives under OUT/wandb
        wandb_env = {k: v for k, v in (("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "online"),
                                       ("WANDB_DIR", str(out)), ("WANDB_PROJECT", "embodistill"))
                     if not os.environ.get(k)}
        report = ["wandb"]
    lm = None
    if cfg.lm_epochs > 0 and init is None:
        from transformers import AutoModelForCausalLM
        lm_final = out / "lm" / "final"
        if not (lm_final / "config.json").is_file():  # else resume: the language-modelling phase is done
            trainer, lm = _train_phase(cfg, model, tok, None, train, val, out / "lm" / "checkpoints", seed, report,
                                       wandb_env, callbacks, bar, assistant_only=False)
            trainer.model.save_pretrained(lm_final)
            write_json(out / "lm" / "metrics.json", lm)
        model = AutoModelForCausalLM.from_pretrained(lm_final)  # a clean model object for the next trainer
        lm = json.loads((out / "lm" / "metrics.json").read_text())
    trainer, m = _train_phase(cfg, model, tok, peft_cfg, train, val, out / "checkpoints", seed, report, wandb_env,
                              callbacks, bar, assistant_only=True)
    if own_bar:
        bar.close()
    if cfg.wandb:
        import wandb
        if wandb.run is not None:
            wandb.finish()
    final = out / "final"
    model = trainer.model
    if peft_cfg is not None:
        model = model.merge_and_unload()  # a plain checkpoint: eval and RL load it like any model
    save_final(model, tok, final)
    metrics = {"train_samples": len(train), "eval_samples": len(val),
               "format": config if isinstance(config, str) else "+".join(config), "params": n_params(model),
               "init": str(init) if init is not None else None,
               **m, "lm_phase": lm, "student": cfg.student.model_dump(mode="json"), "final": str(final)}
    write_json(out / "metrics.json", metrics)
    write_json(out / "manifest.json", {"stage": "sft", "dataset": str(dataset_dir),
                                       "config": json.loads(cfg.model_dump_json())})
    return metrics


class PromptCompletionCollator:
    """GKD batches from chat rows: the whole row (`input_ids`, `attention_mask`, `labels` on the completion only)
    and its prompt with the generation prompt (`prompts`, `prompt_attention_mask`, for the student's own
    completions), all left-padded. The row's `tools` are rendered as at play (`TransformersClient.render_prompt`),
    so a template that lists the tools (a Hub model's) trains on the prompt the student will see. Prompt and
    completion meet at the chat template's special tokens, so the prompt's tokens are a prefix of the row's
    (checked). TRL's `DataCollatorForChatML` does the same through byte offsets, which a tiny student's tokenizer
    (byte-level, with id tokens) does not give monotonically."""

    def __init__(self, tokenizer, max_length: int):
        self.tok, self.max_length = tokenizer, max_length

    def __call__(self, examples: list[dict]) -> dict:
        import torch
        from torch.nn.utils.rnn import pad_sequence
        rows, prompts, labels = [], [], []
        for ex in examples:
            msgs, tools = ex["messages"], ex.get("tools") or None   # the tool schemas, as the student sees them
            prompt = self.tok.apply_chat_template(msgs[:-1], tools=tools, add_generation_prompt=True, tokenize=False)
            full = self.tok.apply_chat_template(msgs, tools=tools, tokenize=False)
            p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
            f_ids = self.tok(full, add_special_tokens=False)["input_ids"]
            if f_ids[: len(p_ids)] != p_ids:
                raise ValueError("gkd: the prompt's tokens are not a prefix of the row's (the chat template joins "
                                 "prompt and completion inside a token)")
            keep = max(0, len(f_ids) - self.max_length)   # cut from the left: the completion stays whole
            rows.append(f_ids[keep:])
            prompts.append(p_ids[keep:])
            labels.append(([-100] * len(p_ids) + f_ids[len(p_ids):])[keep:])

        def left(seqs, value):
            flipped = [torch.tensor(x[::-1], dtype=torch.long) for x in seqs]
            return pad_sequence(flipped, batch_first=True, padding_value=value).flip(1)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        return {"input_ids": left(rows, pad), "attention_mask": left([[1] * len(x) for x in rows], 0),
                "labels": left(labels, -100), "prompts": left(prompts, pad),
                "prompt_attention_mask": left([[1] * len(x) for x in prompts], 0)}


def run_gkd(cfg: SFTSection, dataset_dir: str | Path, out: str | Path, init: str | Path, teacher: str | Path,
            seed: int = 0, lmbda: float = 0.5, beta: float = 0.5, max_new_tokens: int = 96,
            config: str | Sequence[str] = "onpolicy", rows_per_config: dict[str, int] | None = None,
            bar: StageBar | None = None) -> dict:
    """Generalized knowledge distillation (Agarwal et al., "On-Policy Distillation of Language Models", ICLR
    2024) with TRL's `GKDTrainer`: on the collected student prompts, a share `lmbda` of the completions is
    sampled from the student itself, and the loss is the generalized Jensen-Shannon divergence (interpolation
    `beta`) between the teacher's and the student's token distributions. The teacher is a local model folder
    that shares the student's tokenizer (the same vocabulary). Writes OUT/final and OUT/metrics.json, like
    `run_sft`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("manifest.json", "metrics.json"):
        (out / name).unlink(missing_ok=True)
    set_seed(seed)
    for path, what in ((init, "student"), (teacher, "teacher")):
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no {what} model there (no config.json)")
    tok = AutoTokenizer.from_pretrained(init, local_files_only=True)
    t_tok = AutoTokenizer.from_pretrained(teacher, local_files_only=True)
    if t_tok.get_vocab() != tok.get_vocab():
        raise ValueError(f"onpolicy.loss gkd: the teacher {teacher} does not share the student's tokenizer "
                         "(GKD compares token distributions over one vocabulary)")
    model = AutoModelForCausalLM.from_pretrained(init, local_files_only=True)
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, local_files_only=True)
    train, val = training_splits(dataset_dir, config, seed, rows_per_config)
    val = val.select(range(min(cfg.max_eval_samples, len(val))))
    args = GKDConfig(
        output_dir=str(out / "checkpoints"), seed=seed, lmbda=lmbda, beta=beta, max_new_tokens=max_new_tokens,
        temperature=1.0, num_train_epochs=cfg.epochs, max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, lr_scheduler_type=cfg.scheduler,
        logging_steps=cfg.logging_steps, eval_strategy="no", save_strategy="steps", save_steps=cfg.save_steps,
        save_total_limit=2, report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        bf16=use_bf16(cfg.bf16), max_length=cfg.max_length)
    trainer = GKDTrainer(model=model, teacher_model=teacher_model, args=args, train_dataset=train,
                         processing_class=tok, data_collator=PromptCompletionCollator(tok, cfg.max_length))
    trainer.remove_callback(PrinterCallback)
    own_bar = bar is None
    bar = StageBar("gkd", enabled=False) if own_bar else bar
    trainer.add_callback(_progress_callback(bar, "gkd"))
    resume = any((out / "checkpoints").glob("checkpoint-*"))
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    train_s = time.time() - t0
    final = out / "final"
    save_final(trainer.model, tok, final)
    metrics = {"loss": "gkd", "lmbda": lmbda, "beta": beta, "train_samples": len(train), "eval_samples": len(val),
               "steps": trainer.state.global_step, "train_seconds": round(train_s, 1),
               "train_loss": result.training_loss, "eval_loss": None, "params": n_params(trainer.model),
               "init": str(init), "teacher": str(teacher), "final": str(final)}
    write_json(out / "metrics.json", metrics)
    write_json(out / "manifest.json", {"stage": "gkd", "dataset": str(dataset_dir), "teacher": str(teacher)})
    return metrics
