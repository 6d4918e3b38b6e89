"""Model clients that speak the `agent.models.ChatModel` protocol.

* `OpenAIClient`: any OpenAI-compatible endpoint (vLLM serve, a provider) through the official `openai` SDK,
  with bounded, counted retries of its own and a concurrency limit for `chat_many`.
* `TransformersClient`: a local `transformers` causal LM (a folder written by `save_pretrained`, or model
  objects), prompts rendered by the tokenizer's chat template, batched generation with left padding.

Every reply is a `ChatReply`; its action is read by the shared parser (`ChatReply.action()`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import openai
from pydantic import BaseModel, ConfigDict, Field

from agent.models import ChatReply, ModelError
from agent.parser import render_tool_call

log = logging.getLogger(__name__)

_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
MAX_BACKOFF_S = 30.0   # one wait between retries never exceeds this, whatever backoff * 2**k gives


# ----------------------------------------------------------------------------- OpenAI-compatible endpoint


class OpenAIClientConfig(BaseModel):
    """The settings of an `OpenAIClient` (validated: a bad value names its field)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    base_url: str | None = None
    api_key_env: str = Field(default="OPENAI_API_KEY", min_length=1)
    timeout: float = Field(default=60.0, gt=0)
    max_retries: int = Field(default=3, ge=0, le=20)      # retries after the first attempt
    backoff: float = Field(default=0.5, ge=0)             # seconds before the first retry; doubles each time
    max_concurrency: int = Field(default=8, ge=1, le=1024)
    temperature: float = Field(default=0.0, ge=0, le=2)
    seed: int | None = None
    max_tokens: int = Field(default=512, ge=1)
    extra_body: dict[str, Any] | None = None


class OpenAIClient:
    """A chat model behind an OpenAI-compatible `/v1/chat/completions` endpoint.

    The SDK's own retries are off (`max_retries=0`): this client retries timeouts, connection errors, 429
    and 5xx itself, at most `max_retries` times, waiting `backoff * 2**k` seconds scaled by a jitter in
    [0.5, 1.5) drawn from a seeded `random.Random` (so a test run waits the same every time). Other 4xx and
    unreadable replies fail at once. A failure raises `ModelError(kind, message, attempts)`.

    The API key is read from the environment variable `api_key_env`; a server on localhost needs none
    ("EMPTY" is sent). The key is kept out of `repr()`, log lines and error messages.

    `stats` is a snapshot of the counters: `requests` (HTTP requests sent, retries included), `retries`, and
    `errors_by_kind` (calls that failed for good, by `ModelError.kind`).
    """

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 timeout: float = 60.0, max_retries: int = 3, backoff: float = 0.5, max_concurrency: int = 8,
                 temperature: float = 0.0, seed: int | None = None, max_tokens: int = 512,
                 extra_body: dict | None = None):
        self.config = OpenAIClientConfig(model=model, base_url=base_url, api_key_env=api_key_env, timeout=timeout,
                                         max_retries=max_retries, backoff=backoff, max_concurrency=max_concurrency,
                                         temperature=temperature, seed=seed, max_tokens=max_tokens,
                                         extra_body=extra_body)
        self.name = model
        self._api_key = self._read_key(self.config)
        self._sdk = openai.OpenAI(base_url=self.config.base_url, api_key=self._api_key, timeout=self.config.timeout,
                                  max_retries=0)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.config.max_concurrency)  # also across concurrent callers
        self._jitter = random.Random(0 if seed is None else seed)
        self._stats: dict[str, Any] = {"requests": 0, "retries": 0, "errors_by_kind": {}}

    @staticmethod
    def _read_key(cfg: OpenAIClientConfig) -> str:
        key = os.environ.get(cfg.api_key_env, "")
        if key:
            return key
        host = urlparse(cfg.base_url).hostname if cfg.base_url else None
        if host in _LOCAL_HOSTS:
            return "EMPTY"  # vLLM serve and other local servers accept any key
        where = cfg.base_url or "the OpenAI API"
        raise ValueError(f"OpenAIClient: the environment variable {cfg.api_key_env} is not set; it must hold the "
                         f"API key for {where} (only a server on localhost may run without one)")

    def __repr__(self) -> str:
        c = self.config
        return f"OpenAIClient(model={c.model!r}, base_url={c.base_url!r}, api_key_env={c.api_key_env!r})"

    @property
    def stats(self) -> dict:
        with self._lock:
            return copy.deepcopy(self._stats)

    def _scrub(self, text: str) -> str:
        """Error text from a server may echo what it was sent; the key never leaves this object."""
        key = self._api_key
        return text.replace(key, "***") if key and key != "EMPTY" else text

    def retry_delay(self, retry_index: int) -> float:
        """Seconds to wait before retry number `retry_index` (0 for the first retry)."""
        with self._lock:
            jitter = 0.5 + self._jitter.random()
        return min(MAX_BACKOFF_S, self.config.backoff * (2 ** retry_index) * jitter)

    # ------------------------------------------------------------------ the protocol

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, temperature: float | None = None,
             seed: int | None = None, max_tokens: int | None = None, json_mode: bool = False) -> ChatReply:
        cfg = self.config
        params: dict[str, Any] = {"model": cfg.model, "messages": messages,
                                  "temperature": cfg.temperature if temperature is None else temperature,
                                  "max_tokens": cfg.max_tokens if max_tokens is None else max_tokens}
        seed = cfg.seed if seed is None else seed
        if seed is not None:
            params["seed"] = seed
        if tools:
            params["tools"] = tools
        if json_mode:
            params["response_format"] = {"type": "json_object"}
        if cfg.extra_body:
            params["extra_body"] = cfg.extra_body
        return self._request(params)

    def chat_many(self, batch: list[list[dict]], *, tools: list[dict] | None = None,
                  temperature: float | None = None, seed: int | list[int] | None = None,
                  max_tokens: int | None = None, json_mode: bool = False) -> list[ChatReply | ModelError]:
        if not batch:
            return []
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(batch)
        if len(seeds) != len(batch):
            raise ValueError(f"chat_many: {len(seeds)} seeds for {len(batch)} conversations")

        def one(messages: list[dict], one_seed: int | None) -> ChatReply | ModelError:
            try:
                return self.chat(messages, tools=tools, temperature=temperature, seed=one_seed,
                                 max_tokens=max_tokens, json_mode=json_mode)
            except ModelError as e:
                return e

        with ThreadPoolExecutor(max_workers=min(self.config.max_concurrency, len(batch))) as pool:
            futures = [pool.submit(one, m, s) for m, s in zip(batch, seeds, strict=True)]
            return [f.result() for f in futures]

    # ------------------------------------------------------------------ one request, with retries

    def _count(self, key: str, kind: str | None = None) -> None:
        with self._lock:
            if kind is None:
                self._stats[key] += 1
            else:
                self._stats[key][kind] = self._stats[key].get(kind, 0) + 1

    def _request(self, params: dict) -> ChatReply:
        attempts = 0
        while True:
            attempts += 1
            self._count("requests")
            try:
                with self._slots:
                    completion = self._sdk.chat.completions.create(**params)
                return self._reply(completion)
            except openai.APITimeoutError:
                kind, retry, message = "timeout", True, f"no reply within {self.config.timeout} s"
            except openai.APIConnectionError as e:
                kind, retry, message = "connection", True, f"cannot reach the server: {e}"
            except openai.APIStatusError as e:
                kind, message = "http", f"HTTP {e.status_code}: {e.message}"
                retry = e.status_code == 429 or e.status_code >= 500
            except (openai.APIError, ValueError) as e:  # ValueError: a 200 whose body is not JSON
                kind, retry, message = "bad_response", False, f"unreadable reply: {type(e).__name__}: {e}"
            message = self._scrub(message)
            if not retry or attempts > self.config.max_retries:
                self._count("errors_by_kind", kind)
                raise ModelError(kind, message, attempts)
            delay = self.retry_delay(attempts - 1)
            log.warning("%s: %s; retry %d/%d in %.2f s", self.config.model, message, attempts,
                        self.config.max_retries, delay)
            self._count("retries")
            time.sleep(delay)

    @staticmethod
    def _reply(completion: Any) -> ChatReply:
        choices = getattr(completion, "choices", None)
        if not choices:
            raise ValueError("the reply has no choices")
        message = choices[0].message
        if message is None:
            raise ValueError("the reply's first choice has no message")
        calls = []
        for tc in message.tool_calls or []:
            fn = getattr(tc, "function", None)
            if fn is not None:
                calls.append({"name": fn.name, "arguments": fn.arguments})
            elif getattr(tc, "custom", None) is not None:  # a custom (free-text) tool
                calls.append({"name": tc.custom.name, "arguments": tc.custom.input})
        extra = message.model_extra or {}
        reasoning = extra.get("reasoning_content") or extra.get("reasoning") or ""  # vLLM, older and newer
        usage = {}
        if completion.usage is not None:
            usage = {"prompt_tokens": completion.usage.prompt_tokens,
                     "completion_tokens": completion.usage.completion_tokens}
        return ChatReply(text=message.content or "", tool_calls=calls,
                         reasoning=reasoning if isinstance(reasoning, str) else "", usage=usage,
                         model=completion.model or "")


# ----------------------------------------------------------------------------- local transformers model


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    """A torch dtype from a name ("bfloat16") or a dtype; "auto" is passed on for from_pretrained."""
    if not isinstance(dtype, str) or dtype == "auto":
        return dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"TransformersClient: dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    return value


def left_pad(seqs: list[list[int]], pad_id: int):
    """(ids, attention mask) tensors of token-id lists, left-padded so every prompt ends where generation
    starts."""
    import torch
    width = max(len(e) for e in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, e in enumerate(seqs):
        ids[row, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[row, width - len(e):] = 1
    return ids, mask


class TransformersClient:
    """A local causal LM. Prompts are `tokenizer.apply_chat_template(messages, tools=tools,
    add_generation_prompt=True)`; decoding is greedy at temperature 0, else sampled with the RNG seeded from
    `seed` for the call. Only the new tokens are decoded, with special tokens kept (so `<tool_call>` markup
    survives when it is a special token) and the end/pad tokens cut off.

    `model_or_path` is a local folder written by `save_pretrained` (nothing is fetched from the Hub) or a
    model object, which then needs its `tokenizer`. The model is moved to `device`. `json_mode` is accepted
    for the protocol but not enforced: callers validate the JSON. With `constrained`, generation can only
    write a well-formed compact skill call whose id arguments are ids its prompt lists as known and whose enum
    arguments are values of the `tools` it is given (`agent.constrained.CallConstraint`; a tiny student's
    tokenizer).
    The tokenizer is not modified: left padding and the pad-token fallback (eos) happen here.
    """

    def __init__(self, model_or_path: Any, tokenizer: Any = None, device: str = "auto", dtype: Any = None,
                 max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0, batch_size: int = 8,
                 constrained: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_new_tokens < 1 or batch_size < 1 or temperature < 0:
            raise ValueError(f"TransformersClient: max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) "
                             f"must be >= 1 and temperature ({temperature}) >= 0")
        self._torch = torch
        if device == "auto":   # the GPU when there is one
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(model_or_path, (str, os.PathLike)):
            path = Path(model_or_path)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"TransformersClient: {path} is not a model folder (no config.json); "
                                        "pass a local folder written by save_pretrained")
            kwargs = {"local_files_only": True}
            if dtype is not None:
                kwargs["dtype"] = _torch_dtype(torch, dtype)
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path,
                                                                                             local_files_only=True)
            self.name = path.name
        else:
            model = model_or_path
            if tokenizer is None:
                raise ValueError("TransformersClient: a model object needs its tokenizer (tokenizer=...)")
            if dtype is not None and dtype != "auto":
                model = model.to(_torch_dtype(torch, dtype))
            self.name = getattr(model.config, "name_or_path", "") or type(model).__name__
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"TransformersClient: the tokenizer of {self.name} has no chat_template")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = self.model.device
        self.max_new_tokens, self.temperature, self.seed, self.batch_size = max_new_tokens, temperature, seed, \
            batch_size
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        if not eos_ids:
            raise ValueError(f"TransformersClient: {self.name} has no eos token (generation would never stop)")
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._stop = set(self.eos_ids) | {self.pad_id}
        self.constraint = None
        if constrained:
            from agent.constrained import CallConstraint
            self.constraint = CallConstraint(tokenizer)

    def __repr__(self) -> str:
        return f"TransformersClient({self.name!r}, device={str(self.device)!r})"

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The exact prompt text the model continues (the chat template with the generation prompt)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    def decode_new(self, new_ids: list[int]) -> tuple[str, int]:
        """Text of generated ids up to the first end or pad token, special tokens kept; and how many ids."""
        kept = []
        for t in new_ids:
            if t in self._stop:
                break
            kept.append(t)
        text = self.tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text.strip(), len(kept)

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, temperature: float | None = None,
             seed: int | None = None, max_tokens: int | None = None, json_mode: bool = False) -> ChatReply:
        return self._generate([messages], tools, temperature, seed, max_tokens)[0]

    def chat_many(self, batch: list[list[dict]], *, tools: list[dict] | None = None,
                  temperature: float | None = None, seed: int | list[int] | None = None,
                  max_tokens: int | None = None, json_mode: bool = False) -> list[ChatReply | ModelError]:
        """Batches of `batch_size` conversations, one `generate` call each: sampling draws a whole batch from one
        generator, seeded by the batch's first seed (a list), or by `seed + batch number` (an int)."""
        out: list[ChatReply | ModelError] = []
        base = self.seed if seed is None else seed
        for i in range(0, len(batch), self.batch_size):
            one = base[i] if isinstance(base, (list, tuple)) else base + i // self.batch_size
            out += self._generate(batch[i: i + self.batch_size], tools, temperature, one, max_tokens)
        return out

    def _generate(self, batch: list[list[dict]], tools, temperature, seed, max_tokens) -> list[ChatReply]:
        torch = self._torch
        temperature = self.temperature if temperature is None else temperature
        seed = self.seed if seed is None else seed
        texts = [self.render_prompt(m, tools) for m in batch]
        encoded = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        ids, mask = left_pad(encoded, self.pad_id)
        width = ids.shape[1]
        extra = {}
        if self.constraint is not None:
            from transformers import LogitsProcessorList
            extra["logits_processor"] = LogitsProcessorList([self.constraint.processor(texts, width, tools)])
        gen: dict[str, Any] = {"max_new_tokens": self.max_new_tokens if max_tokens is None else max_tokens,
                               "pad_token_id": self.pad_id, "eos_token_id": self.eos_ids}
        if temperature > 0:
            gen.update(do_sample=True, temperature=temperature)
        else:
            gen.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        config = copy.deepcopy(self.model.generation_config)
        config.update(**gen)
        # HF generate samples from torch's global RNG: seed it for this call only, then give the caller's back
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config, **extra)
        replies = []
        for row, e in enumerate(encoded):
            text, n_new = self.decode_new(out[row, width:].tolist())
            replies.append(ChatReply(text=text, usage={"prompt_tokens": len(e), "completion_tokens": n_new},
                                     model=self.name))
        return replies


def tool_call_text(reply: ChatReply) -> str:
    """The reply as the text a model would have written: its content, then each OpenAI tool call rendered as
    `<tool_call>` markup (arguments as sent; a JSON string is decoded when it can be)."""
    parts = [reply.text] if reply.text else []
    for call in reply.tool_calls:
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                parts.append("<tool_call>\n" + json.dumps({"name": call.get("name"), "arguments": args}) +
                             "\n</tool_call>")
                continue
        if isinstance(args, dict):
            parts.append(render_tool_call(str(call.get("name")), args))
        else:
            parts.append("<tool_call>\n" + json.dumps({"name": call.get("name"), "arguments": args}) +
                         "\n</tool_call>")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- building a client from config


class ClientSpec(BaseModel):
    """A model client as a recipe names it. `openai`: any OpenAI-compatible endpoint (`model`, `base_url`, key
    from `api_key_env`); `transformers`: a local folder (`model` is its path)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["openai", "transformers"]
    model: str = Field(min_length=1)
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = Field(default=60.0, gt=0)
    max_retries: int = Field(default=3, ge=0, le=20)
    max_concurrency: int = Field(default=8, ge=1, le=1024)
    temperature: float = Field(default=0.0, ge=0, le=2)
    seed: int | None = None
    max_tokens: int = Field(default=512, ge=1)
    device: str = "auto"     # transformers: "auto" is the GPU when there is one, else the CPU


def make_client(spec: ClientSpec):
    """The ChatModel a spec describes."""
    if spec.kind == "openai":
        return OpenAIClient(spec.model, base_url=spec.base_url, api_key_env=spec.api_key_env, timeout=spec.timeout,
                            max_retries=spec.max_retries, max_concurrency=spec.max_concurrency,
                            temperature=spec.temperature, seed=spec.seed, max_tokens=spec.max_tokens)
    return TransformersClient(spec.model, device=spec.device, max_new_tokens=spec.max_tokens,
                              temperature=spec.temperature, seed=spec.seed or 0)
