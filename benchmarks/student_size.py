"""What a bigger tiny student costs: SFT step time and generation speed per student size, side by side.

    python benchmarks/student_size.py                      # recipes/medium.yaml's student and two larger ones
    python benchmarks/student_size.py --steps 6 --sizes default 5m

For each size (`default` is the recipe's `sft.student`; `5m` and `15m` widen and deepen it), a student is built
from its config (Llama architecture, the recipe's tokenizer settings, a tokenizer trained here on the distilled
rows) and timed on the same real batches of the recipe's distilled dataset (distilled under OUT when missing):
- `sft_step_s`: one assistant-only SFT step (forward, backward, AdamW) on `batch_size` rows, in bf16 autocast where
  `sft.bf16: auto` chooses it, every batch padded to one width, the median of `--steps` steps after one warm-up,
  the sizes interleaved step by step so that a slow moment of a shared machine hits them all;
- `generate_tokens_per_s`: greedy generation of 24 new tokens for a batch of 32 prompts (what rollouts and
  evaluations spend their time on);
- the ratios to `default`, and `sft_minutes_at_recipe_steps`: the step time times the recipe's SFT steps
  (language-modelling and assistant-only phases), an estimate of the SFT stage's wall time at that size.

Prints one JSON object. Ratios compare sizes within one run; absolute seconds depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SIZES = {"default": {},
         "5m": {"hidden_size": 256, "intermediate_size": 768, "num_layers": 6},
         "15m": {"hidden_size": 384, "intermediate_size": 1152, "num_layers": 8, "num_heads": 6}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "medium.yaml"))
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-student-size"))
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["default", "5m", "15m"])
    ap.add_argument("--steps", type=int, default=10, help="timed SFT steps per size (after one warm-up)")
    args = ap.parse_args()

    import torch
    from learning import _cpu   # benchmarks/learning.py: the CPU model and its bf16 support
    from pipeline.recipe import load_recipe
    from pipeline.stages import run_distill_stage
    from sft.student import StudentConfig, build_tiny_student, corpus_texts, n_params, train_tokenizer
    from sft.train import load_sft_dataset, use_bf16

    recipe = load_recipe(args.recipe)
    out = Path(args.out)
    if not (out / "distill" / "manifest.json").is_file():
        run_distill_stage(recipe, out / "distill", show_progress=False)
    rows = load_sft_dataset(out / "distill" / "dataset", recipe.distill.sample_format)["train"]
    lm_steps, sft_steps = _recipe_steps(recipe, len(rows))
    rows = rows.shuffle(seed=0).select(range(min(len(rows), 2000)))
    base = recipe.sft.student
    tok = train_tokenizer(corpus_texts(rows), base.vocab_size, base.reasoning, base.name_tokens, base.skip_lines,
                          base.short_memory)
    bs = recipe.sft.batch_size
    encoded = [_encode(tok, rows[i]) for i in range((args.steps + 1) * bs)]
    width = max(len(x) for x in encoded)   # one shape for every step: the warm-up step pays the kernels' setup
    batches = [_batch(tok, encoded[k * bs:(k + 1) * bs], width) for k in range(args.steps + 1)]
    prompts = [tok.apply_chat_template(rows[i]["messages"][:-1], tools=rows[i]["tools"], add_generation_prompt=True,
                                       tokenize=False) for i in range(32)]
    bf16 = use_bf16(recipe.sft.bf16)

    models, opts, step_s = {}, {}, {}
    for name in args.sizes:
        cfg = StudentConfig.model_validate({**base.model_dump(), **SIZES[name]})
        models[name] = build_tiny_student(cfg, tok, seed=0)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=recipe.sft.lr)
        step_s[name] = []
    for k, batch in enumerate(batches):   # step k of every size, then step k + 1: interleaved
        for name in args.sizes:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = models[name](**batch).loss
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            if k > 0:
                step_s[name].append(time.perf_counter() - t0)

    gen = {}
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    for name in args.sizes:
        model = models[name].eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model.generate(**enc, max_new_tokens=4, do_sample=False)   # warm-up
            t0 = time.perf_counter()
            new = model.generate(**enc, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        gen[name] = (new.shape[1] - enc["input_ids"].shape[1]) * new.shape[0] / (time.perf_counter() - t0)

    report = {"benchmark": "student_size", "recipe": recipe.name, "cpu": _cpu(), "torch_threads":
              torch.get_num_threads(), "bf16": bf16, "batch_size": bs,
              "batch_tokens_mean": round(statistics.fmean(int(b["attention_mask"].sum()) for b in batches[1:]), 1),
              "recipe_sft_steps": {"language_modelling": lm_steps, "assistant_only": sft_steps}, "sizes": {}}
    ref = args.sizes[0]
    for name in args.sizes:
        med = statistics.median(step_s[name])
        report["sizes"][name] = {
            "student": {k: v for k, v in models[name].config.to_dict().items()
                        if k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "vocab_size")},
            "params": n_params(models[name]), "sft_step_s": round(med, 3),
            "sft_step_ratio": round(med / statistics.median(step_s[ref]), 2),
            "generate_tokens_per_s": round(gen[name], 1),
            "generate_ratio": round(gen[name] / gen[ref], 2),
            "sft_minutes_at_recipe_steps": round(med * (lm_steps + sft_steps) / 60, 1)}
    print(json.dumps(report, indent=2))


def _encode(tok, row: dict) -> list[int]:
    return tok.apply_chat_template(row["messages"], tools=row["tools"], tokenize=True, return_dict=False)


def _batch(tok, ids: list[list[int]], width: int) -> dict:
    """Rendered rows right-padded to `width`; labels on every real token (an assistant-only step costs the same)."""
    import torch
    input_ids = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}


def _recipe_steps(recipe, n_rows: int) -> tuple[int, int]:
    """The recipe's SFT optimizer steps on `n_rows` train rows: epochs x rows / batch size for the
    language-modelling phase (every token of the same rows) and the assistant-only phase."""
    import math
    per_epoch = math.ceil(n_rows / (recipe.sft.batch_size * recipe.sft.grad_accum))
    return round(recipe.sft.lm_epochs * per_epoch), round(recipe.sft.epochs * per_epoch)


if __name__ == "__main__":
    main()
