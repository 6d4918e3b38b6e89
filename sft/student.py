"""Student construction: a tiny model from scratch (BPE tokenizer trained here, Llama config sized by the
recipe) or any Hub model id / local path with its own chat template (LoRA through PEFT).

The tiny student's chat template:
- roles are special tokens (`<|user|>`, `<|assistant|>`, `<|tool|>`, `<|end|>`), so a prompt always ends on a
  special token and the completion never starts inside a BPE merge;
- assistant turns sit in `{% generation %}` blocks, so `return_assistant_tokens_mask` marks exactly them
  (TRL's `assistant_only_loss`);
- tool calls are rendered compactly, `<tool_call>navigate kitchen</tool_call>` (arguments in the skill's
  parameter order, `|`-separated; `agent.parser.parse_compact` reads them back). The dataset keeps the
  standard `tool_calls` structure; only this template is compact, because a few-million-parameter model
  learns a short action string far sooner than JSON boilerplate;
- the system message is not rendered (it is the same in every sample and carries nothing the tiny student
  needs; it is dropped the same way at training and inference, so both see identical tokens);
- the assistant's reasoning is rendered only when the template is built with `reasoning=True`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.parser import render_compact
from sandbox.skills import SKILLS

SPECIAL = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>",
           "</tool_call>", "<|unk|>"]


class StudentConfig(BaseModel):
    """Recipe `sft.student`: `tiny` (from scratch) or a Hub id / local path (`base`)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tiny", "pretrained"] = "tiny"
    base: str | None = None                  # pretrained: Hub id or local folder
    vocab_size: int = Field(default=2048, ge=300, le=65_536)
    hidden_size: int = Field(default=160, ge=16, le=8192)
    intermediate_size: int = Field(default=480, ge=16, le=32_768)
    num_layers: int = Field(default=4, ge=1, le=64)
    num_heads: int = Field(default=4, ge=1, le=128)
    num_kv_heads: int = Field(default=2, ge=1, le=128)
    max_positions: int = Field(default=1024, ge=64, le=131_072)
    reasoning: bool = False                  # tiny template: render the assistant's thought before the call
    lora_r: int = Field(default=16, ge=0, le=512)  # pretrained: LoRA rank (0 = full fine-tuning)
    lora_alpha: int = Field(default=32, ge=1)
    lora_targets: list[str] | str = "all-linear"


def _compact_macro() -> str:
    """Jinja that renders one tool call compactly, the skill's parameters in order (from `sandbox.skills`)."""
    lines = ["{%- macro compact(fn) -%}", "{%- set a = fn.arguments -%}", "{{- fn.name -}}"]
    branches = []
    for name, skill in SKILLS.items():
        if not skill.params:
            continue
        parts = []
        for i, p in enumerate(skill.params):
            sep = " " if i == 0 else "|"
            parts.append("{%- if a['" + p.name + "'] is defined and a['" + p.name + "'] is not none -%}" +
                         "{{- '" + sep + "' ~ a['" + p.name + "'] -}}{%- endif -%}")
        branches.append(("{%- if" if not branches else "{%- elif") + f" fn.name == '{name}' -%}}" + "".join(parts))
    lines += branches + ["{%- endif -%}", "{%- endmacro -%}"]
    return "".join(lines)


def tiny_chat_template(reasoning: bool = False) -> str:
    think = "{%- if m.content %}{{ m.content }}\n{% endif -%}" if reasoning else ""
    return _compact_macro() + (
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' -%}<|user|>{{ m.content }}<|end|>"
        "{%- elif m.role == 'tool' -%}<|tool|>{{ m.content }}<|end|>"
        "{%- elif m.role == 'assistant' -%}<|assistant|>{% generation %}" + think +
        "{%- for tc in (m.tool_calls or []) -%}<tool_call>{{ compact(tc.function if tc.function is defined "
        "else tc) }}</tool_call>{%- endfor -%}<|end|>{% endgeneration %}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")


def corpus_texts(rows: Iterable[dict]) -> Iterable[str]:
    """The strings the tiny tokenizer is trained on: message contents and compact call renderings."""
    for row in rows:
        for m in row["messages"]:
            if m.get("content"):
                yield m["content"]
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function", tc)
                args = fn.get("arguments") or {}
                if isinstance(args, str):
                    args = json.loads(args)
                yield render_compact(fn["name"], args)


def train_tokenizer(texts: Iterable[str], vocab_size: int, reasoning: bool = False):
    """A byte-level BPE tokenizer trained on `texts`, with the chat special tokens and the tiny template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    # an id is the same token wherever it stands: "[red_ball]" and "navigate(room_0_1)" read as "[ red_ball]" and
    # "( room_0_1)", so the id carries the leading space it has in lists and calls (" red_ball"); otherwise each id
    # is two unrelated tokens and copying one from an observation into a call must first learn the pairing
    tok.normalizer = normalizers.Sequence([normalizers.Replace("[", "[ "), normalizers.Replace("(", "( ")])
    # ids stay whole words (`kitchen_counter`, `door_hallway_kitchen`, `charger_1`): copying an id from the
    # prompt into a call is then one token to copy, and prompts are shorter than with GPT-2's split at "_"
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   unk_token="<|unk|>", model_max_length=4096)
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL if t not in
                                                           ("<|pad|>", "<|end|>", "<|unk|>")]})
    fast.chat_template = tiny_chat_template(reasoning)
    return fast


def build_tiny_student(cfg: StudentConfig, tokenizer, seed: int = 0):
    """A Llama-architecture model sized by the recipe, initialised from `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                       max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, rope_theta=10_000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(conf)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_pretrained_student(cfg: StudentConfig):
    """Any Hub id or local folder with its own chat template; LoRA adapters through PEFT when lora_r > 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not cfg.base:
        raise ValueError("sft.student.base: a Hub model id or a local folder is needed for kind: pretrained")
    local = Path(cfg.base).is_dir()
    tok = AutoTokenizer.from_pretrained(cfg.base, local_files_only=local)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"sft.student.base {cfg.base}: the tokenizer has no chat template")
    model = AutoModelForCausalLM.from_pretrained(cfg.base, local_files_only=local, dtype="auto")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def lora_config(cfg: StudentConfig):
    if cfg.kind != "pretrained" or cfg.lora_r == 0:
        return None
    from peft import LoraConfig
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_targets,
                      lora_dropout=0.0, task_type="CAUSAL_LM")


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
