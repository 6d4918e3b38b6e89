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
- the assistant's reasoning is rendered only when the template is built with `reasoning=True`;
- user-message lines that start with one of `skip_lines` are not rendered (the recipe's `skip_lines`: a line the
  tiny student never needs, such as the rooms scene's `Places:` list, whose ids and names the observations and
  the other lines already give, costs compute at every training step and every rollout step); with
  `short_memory`, the memory of a step that succeeded is its call and "ok" (see `_user_content`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.parser import render_compact
from agent.prompt import MEMORY_OK
from sandbox.skills import SKILLS, id_words

SPECIAL = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>",
           "</tool_call>", "<|unk|>"]


class StudentConfig(BaseModel):
    """Recipe `sft.student`: `tiny` (from scratch) or a Hub id / local path (`base`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

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
    name_tokens: bool = True                 # tiny tokenizer: "the yellow key" reads as `yellow_key` (below)
    skip_lines: list[str] = []               # tiny template: user-message lines starting so are not rendered
    short_memory: bool = False               # tiny template: a Recent line of a step that succeeded is "call -> ok"
    lora_r: int = Field(default=16, ge=0, le=512)  # pretrained: LoRA rank (0 = full fine-tuning)
    lora_alpha: int = Field(default=32, ge=1)
    lora_targets: list[str] | str = "all-linear"

    @model_validator(mode="after")
    def _template_options_for_tiny_only(self):
        # checked with the recipe, before any stage runs
        if self.kind != "tiny" and (self.skip_lines or self.short_memory):
            raise ValueError("skip_lines and short_memory shape the tiny student's own chat template (student.kind "
                             "tiny); a pretrained student keeps its template")
        _check_line_prefixes(self.skip_lines)
        return self


def _check_line_prefixes(skip_lines: list[str]) -> None:
    for prefix in skip_lines:
        if not prefix or "'" in prefix or "\\" in prefix or "\n" in prefix:
            raise ValueError(f"skip_lines: {prefix!r} must be a non-empty line prefix without quotes, "
                             "backslashes or newlines")


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


def _user_content(skip_lines: list[str], short_memory: bool = False) -> str:
    """Jinja for a user message's text, without the lines that start with one of `skip_lines`; with
    `short_memory`, a `Recent:` line of a step that succeeded keeps the call and "ok" but not the first sentence
    of what it observed (the builder's `- call -> ok: gist`, `agent.prompt.MEMORY_OK`): the newest observation is
    in full on its own line and what steps found lives on in the known map and facts; a failed step keeps its
    error and gist."""
    if not skip_lines and not short_memory:
        return "{{ m.content }}"
    _check_line_prefixes(skip_lines)
    keep = ("not line.startswith(" + "(" + ", ".join(f"'{p}'" for p in skip_lines) + ",))") if skip_lines \
        else "true"
    ok, cut = MEMORY_OK.rstrip(": "), f"'{MEMORY_OK}'"  # " -> ok", and the quoted separator
    text = ("{%- if line.startswith('- ') and " + cut + " in line -%}{{ line.split(" + cut + ")[0] ~ '" + ok + "' }}"
            "{%- else -%}{{ line }}{%- endif -%}") if short_memory else "{{ line }}"
    return ("{%- set ns = namespace(first=true) -%}"
            "{%- for line in m.content.split('\n') -%}"
            "{%- if " + keep + " -%}"
            "{%- if not ns.first %}{{ '\n' }}{% endif -%}" + text + "{%- set ns.first = false -%}"
            "{%- endif -%}{%- endfor -%}")


def tiny_chat_template(reasoning: bool = False, skip_lines: list[str] | None = None,
                       short_memory: bool = False) -> str:
    think = "{%- if m.content %}{{ m.content }}\n{% endif -%}" if reasoning else ""
    return _compact_macro() + (
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' -%}<|user|>" + _user_content(skip_lines or [], short_memory) + "<|end|>"
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


# An id made of words (`yellow_key`, `kitchen_counter`, a look-alike `yellow_key_2`) is split at its words
# (" yellow" "_key"): its first word is the very token of the instruction's "the yellow key", so a call copies the
# colour from the instruction or the prompt and adds the type, and an id never targeted in training (the
# compositional split) is made of tokens that were. Whole, `yellow_key` is one token per colour and type: copying
# it confused look-alikes (`grey_box` for `grey_key`), and one never targeted is a token never output. Ids with
# numbers (`room_0_1`, `charger_1`, `blue_door_room_0_2_room_1_2`) stay whole: one token to copy, short prompts.
_WORD, _END = r"[A-Za-z]+", r"(?:_[0-9]+)*(?![A-Za-z0-9_])"
ID_WORDS = (rf" ?{_WORD}(?=(?:_{_WORD})+{_END})"     # the first word of an id made of words
            rf"|_{_WORD}(?:_[0-9]+)*(?=(?:_{_WORD})*{_END})"  # each later word (with a look-alike's number)
            r"| ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]+|\s+")  # other ids and words, punctuation, spaces


_BRACKETED_ID = re.compile(r"\[([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\]")


def object_names(texts: Iterable[str]) -> dict[str, str]:
    """Prose name -> id for the bracketed ids made of words whose name the corpus also writes as prose:
    observations say "yellow key [yellow_key]", so "yellow key" -> "yellow_key". A look-alike's numbered id
    (`yellow_key_2`) gives the unnumbered one; an id with numbers inside (`room_0_1`, door ids) gives none."""
    texts = list(texts)
    names = {}
    for oid in {i for text in texts for i in _BRACKETED_ID.findall(text)}:
        words = id_words(oid)
        if len(words) > 1 and all(w.isalpha() for w in words):
            names[" ".join(words)] = "_".join(words)
    blob = "\n".join(texts)
    return {name: base for name, base in sorted(names.items()) if re.search(rf"\b{re.escape(name)}\b", blob)}


def train_tokenizer(texts: Iterable[str], vocab_size: int, reasoning: bool = False, name_tokens: bool = True,
                    skip_lines: list[str] | None = None, short_memory: bool = False):
    """A byte-level BPE tokenizer trained on `texts`, with the chat special tokens and the tiny template.

    With `name_tokens` the normalizer also reads an object's prose name as its id ("go to the yellow key" as "go
    to the yellow_key", i.e. " yellow" "_key"), so the instruction, the lists and the call carry the object as the
    same tokens, and the type to write after a colour is the one that follows it in the instruction itself (with
    prose "key" and id "_key" as different tokens the student wrote the colour right and the type of another
    object of that colour). Only what the model reads changes: its calls hold ids and decode as written.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts)
    tok = Tokenizer(models.BPE(unk_token=None))
    # an id is the same token wherever it stands: "[red_ball]" and "navigate(room_0_1)" read as "[ red_ball]" and
    # "( room_0_1)", so the id carries the leading space it has in lists and calls (" red_ball"); otherwise each id
    # is two unrelated tokens and copying one from an observation into a call must first learn the pairing; the
    # same for a compact call's later arguments ("place purple_box| red_key": the parser strips the space)
    rules = [normalizers.Replace("[", "[ "), normalizers.Replace("(", "( "), normalizers.Replace("|", "| ")]
    if name_tokens:  # longest names first, so that a longer name is not cut by a shorter one inside it
        rules += [normalizers.Replace(Regex(rf"\b{re.escape(name)}\b"), oid)
                  for name, oid in sorted(object_names(texts).items(), key=lambda kv: -len(kv[0]))]
    tok.normalizer = normalizers.Sequence(rules)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(ID_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   unk_token="<|unk|>", model_max_length=4096)
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL if t not in
                                                           ("<|pad|>", "<|end|>", "<|unk|>")]})
    fast.chat_template = tiny_chat_template(reasoning, skip_lines, short_memory)
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
