"""Supervised fine-tuning with TRL's SFTTrainer: assistant-only loss, optional packing, an eval split, wandb
logging (offline unless configured), checkpoints and resume.

    from sft.train import SFTSection, run_sft
    run_sft(SFTSection(), dataset_dir="outputs/tiny/distill/dataset", out="outputs/tiny/sft", seed=0)

The dataset is the distillation artifact (parquet + card; `datasets.load_dataset(dir, config)`), in the
conversational format TRL takes as is (`messages` with `tool_calls`, `tool` results, and `tools`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.trajectory import write_json
from sft.student import (StudentConfig, build_tiny_student, corpus_texts, load_pretrained_student, lora_config,
                         n_params, train_tokenizer)


class SFTSection(BaseModel):
    """Recipe `sft:`."""

    model_config = ConfigDict(extra="forbid")

    student: StudentConfig = Field(default_factory=StudentConfig)
    epochs: float = Field(default=2.0, gt=0)
    max_steps: int = Field(default=-1, ge=-1)           # > 0 overrides epochs
    batch_size: int = Field(default=16, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    lr: float = Field(default=2e-3, gt=0, le=1.0)
    warmup_ratio: float = Field(default=0.03, ge=0, le=0.5)
    scheduler: Literal["cosine", "linear", "constant_with_warmup"] = "cosine"
    weight_decay: float = Field(default=0.0, ge=0)
    max_length: int = Field(default=1024, ge=32)
    packing: bool = False
    eval_steps: int = Field(default=200, ge=1)
    save_steps: int = Field(default=200, ge=1)
    logging_steps: int = Field(default=20, ge=1)
    max_eval_samples: int = Field(default=256, ge=1)
    max_train_samples: int | None = Field(default=None, ge=1)
    wandb: bool = False       # report to wandb (offline unless WANDB_MODE / WANDB_API_KEY say otherwise)
    threads: int | None = Field(default=None, ge=1)


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


def load_sft_dataset(dataset_dir: str | Path, config: str):
    from datasets import load_dataset
    dataset_dir = Path(dataset_dir)
    if not (dataset_dir / "README.md").is_file():
        raise FileNotFoundError(f"{dataset_dir}: no dataset card (README.md); run `embodistill distill` first")
    ds = load_dataset(str(dataset_dir), config)
    for split in ("train", "validation"):
        if split not in ds:
            raise ValueError(f"{dataset_dir} config {config!r} has no {split} split")
    return ds


def make_student(cfg: StudentConfig, train_rows, seed: int):
    """(model, tokenizer, peft_config) for the recipe's student."""
    if cfg.kind == "tiny":
        tok = train_tokenizer(corpus_texts(train_rows), cfg.vocab_size, reasoning=cfg.reasoning)
        return build_tiny_student(cfg, tok, seed), tok, None
    model, tok = load_pretrained_student(cfg)
    return model, tok, lora_config(cfg)


def run_sft(cfg: SFTSection, dataset_dir: str | Path, out: str | Path, seed: int = 0, show_progress: bool = True,
            callbacks=None, config: Literal["step", "conversation"] = "step") -> dict:
    """Train the student on one dataset config (`step`: per-step prompts as RL shows them; `conversation`:
    whole multi-turn episodes) and write OUT/final, OUT/checkpoints, OUT/metrics.json."""
    import torch
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_seed(seed)
    ds = load_sft_dataset(dataset_dir, config)
    train, val = ds["train"], ds["validation"]
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    val = val.select(range(min(cfg.max_eval_samples, len(val))))
    student_dir = out / "student_init"
    if cfg.student.kind == "tiny" and (student_dir / "config.json").is_file():
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
    report = []
    if cfg.wandb:
        os.environ.setdefault("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "online")
        os.environ.setdefault("WANDB_DIR", str(out))
        report = ["wandb"]
    ckpt_dir = out / "checkpoints"
    args = SFTConfig(
        output_dir=str(ckpt_dir), seed=seed, data_seed=seed, assistant_only_loss=True, packing=cfg.packing,
        max_length=cfg.max_length, num_train_epochs=cfg.epochs, max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, warmup_steps=cfg.warmup_ratio,
        lr_scheduler_type=cfg.scheduler, weight_decay=cfg.weight_decay, logging_steps=cfg.logging_steps,
        eval_strategy="steps", eval_steps=cfg.eval_steps, save_strategy="steps", save_steps=cfg.save_steps,
        save_total_limit=2, report_to=report, disable_tqdm=not show_progress, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available() and cfg.student.kind != "tiny",
        dataset_num_proc=None, remove_unused_columns=True, train_sampling_strategy="group_by_length")
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=val, processing_class=tok,
                         peft_config=peft_cfg, callbacks=callbacks)
    if not cfg.packing:
        trainer.data_collator = RightPaddedCausalCollator(trainer.data_collator)
    resume = any(ckpt_dir.glob("checkpoint-*"))
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    train_s = time.time() - t0
    final = out / "final"
    model = trainer.model
    if peft_cfg is not None:
        model = model.merge_and_unload()  # a plain checkpoint: eval and RL load it like any model
    model.save_pretrained(final)
    tok.save_pretrained(final)
    ev = trainer.evaluate()
    curve = [{k: r[k] for k in ("step", "loss", "eval_loss", "learning_rate") if k in r} for r in
             trainer.state.log_history]
    metrics = {"train_samples": len(train), "eval_samples": len(val), "format": config,
               "params": n_params(model), "steps": trainer.state.global_step, "epochs": trainer.state.epoch,
               "train_seconds": round(train_s, 1), "train_loss": result.training_loss,
               "eval_loss": ev.get("eval_loss"), "resumed": resume, "curve": curve,
               "student": cfg.student.model_dump(mode="json"), "final": str(final)}
    write_json(out / "metrics.json", metrics)
    write_json(out / "manifest.json", {"stage": "sft", "dataset": str(dataset_dir),
                                       "config": json.loads(cfg.model_dump_json())})
    return metrics
