"""The verl plugin (`rl.verl_plugin`): registration through verl's registries, the "gigpo" estimator against
`rl.gigpo.compute_gigpo_advantages`, the v1 trainer mode's _compute_advantage (verl's own code, an in-memory
TransferQueue), and the sandbox agent loop with a scripted generation server. Needs the `verl` extra, which pins
transformers < 5.11: skipped in the main environment; CI runs it in an environment of its own
(`bash .ci/extra-env verl tests/test_verl_plugin.py`), where a skip fails the run."""

from __future__ import annotations

import ast
import asyncio
import copy
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import rl.verl_plugin as plugin  # noqa: E402
from rl.gigpo import compute_gigpo_advantages  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ a hand-made batch


def _key(i: int) -> str:
    return f"{i:016x}"   # state keys look like World.state_key(): 16 hex digits


# (uid, session, anchors, step rewards, episode return): three episode groups and a padding-like row
EPISODES = [
    ("ga", 0, [1, 2, 3, 2], [0.125, -0.125, 0.0, 1.0], 1.5),   # revisits state 2
    ("ga", 1, [1, 2, 4], [0.125, 0.125, 0.5], 0.75),
    ("ga", 2, [1, 5], [-0.125, 0.0], 0.0),
    ("gb", 0, [1, 6], [0.125, 1.0], 1.25),                       # state 1 again, in another episode group
    ("gb", 1, [1, 6, 7], [0.0, 0.25, 0.0], 0.25),
    ("gc", 0, [8, 9], [0.5, 0.5], 1.0),                          # a group of one trajectory
]
PAD = ("padq", 0, [1], [0.375], 0.0)                              # like verl's synthetic padding: mask all 0
WIDTH = 6


def hand_batch(with_pad: bool = True):
    """Rows in a shuffled order: per-row inputs, token tensors (R at the last response token, as verl's
    rm_scores) and the response lengths."""
    rows = []
    for uid, session, anchors, rewards, ret in EPISODES + ([PAD] if with_pad else []):
        for t, (a, r) in enumerate(zip(anchors, rewards, strict=True)):
            rows.append({"uid": uid, "traj_uid": f"{uid}_{session}", "step_idx": t, "anchor_key": _key(a),
                         "step_reward": r, "ret": ret, "pad": uid == PAD[0]})
    order = np.random.default_rng(7).permutation(len(rows))
    rows = [rows[i] for i in order]
    n = len(rows)
    lengths = [0 if row["pad"] else 1 + (3 * i) % WIDTH for i, row in enumerate(rows)]
    mask = torch.zeros(n, WIDTH, dtype=torch.int64)
    rewards = torch.zeros(n, WIDTH, dtype=torch.float32)
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        mask[i, :length] = 1
        rewards[i, max(length, 1) - 1] = row["ret"]
    cols = {f: np.array([row[f] for row in rows]) for f in ("uid", "traj_uid", "step_idx", "anchor_key",
                                                              "step_reward", "ret")}
    return cols, rewards, mask, lengths


def expected(cols, **settings) -> np.ndarray:
    return compute_gigpo_advantages(cols["uid"], cols["traj_uid"], cols["step_idx"], cols["anchor_key"],
                                    cols["step_reward"], cols["ret"], **settings)


def check_broadcast(adv: torch.Tensor, per_row: np.ndarray, lengths) -> None:
    """Each row's advantage on its response tokens, 0 on the rest; the numbers exactly the estimator's."""
    want = torch.as_tensor(per_row, dtype=torch.float32)
    for i, length in enumerate(lengths):
        assert torch.equal(adv[i, :length], want[i].expand(length)), i
        assert torch.equal(adv[i, length:], torch.zeros(WIDTH - length)), i


def algorithm_config(**kw):
    base = {"adv_estimator": "gigpo", "gamma": 0.9, "lam": 1.0, "norm_adv_by_std_in_grpo": True,
            "use_kl_in_reward": False}
    return OmegaConf.create({**base, **kw})


# ------------------------------------------------------------------------------------------------ registration


def test_the_module_imports_no_verl_at_import_time():
    tree = ast.parse((ROOT / "rl" / "verl_plugin.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names] + \
            [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m and m.split(".")[0] in ("verl", "torch", "ray", "transfer_queue")]


def test_register_is_idempotent_and_uses_verls_registries():
    from hydra.utils import get_class
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo import core_algos

    first = plugin.register()
    assert plugin.register() == first
    assert first["adv_estimator"] == "gigpo" and first["agent_loop"] == "embodistill_sandbox"
    assert core_algos.get_adv_estimator_fn("gigpo") is plugin.compute_gigpo_advantage
    assert _agent_loop_registry["embodistill_sandbox"] == {"_target_": "rl.verl_plugin.SandboxAgentLoop"}
    assert get_class("rl.verl_plugin.SandboxAgentLoop") is plugin.SandboxAgentLoop   # how verl's worker finds it
    if first["trainer_mode"] is not None:
        from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
        assert get_trainer_cls("embodistill_gigpo") is plugin.VerlGiGPOTrainer
        assert issubclass(plugin.VerlGiGPOTrainer, PPOTrainerSync)
    # another function under the name is refused by verl itself
    with pytest.raises(ValueError, match="already been registered"):
        core_algos.register_adv_est("gigpo")(lambda **kw: None)


def test_missing_verl_says_to_install_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[verl\]'"):
        plugin.register()


# ------------------------------------------------------------------------------------------------ the estimator


def test_gigpo_through_verls_compute_advantage_equals_the_project_estimator():
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage
    plugin.register()
    cols, rewards, mask, lengths = hand_batch()
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.array(cols["uid"], dtype=object)})
    with plugin.published_step_inputs(cols, step_weight=0.5):
        out = compute_advantage(data, adv_estimator="gigpo", config=algorithm_config())
    want = expected(cols, gamma=0.9, step_weight=0.5, normalize="mean_std")
    check_broadcast(out.batch["advantages"], want, lengths)
    assert torch.equal(out.batch["returns"], out.batch["advantages"])
    # the cases that carry meaning: a one-trajectory group and its one-row step groups give exactly 0,
    # a repeated state (state 1 in group ga) gives a non-zero step-level term
    solo = cols["uid"] == "gc"
    assert np.all(want[solo] == 0.0)
    episode_only = expected(cols, gamma=0.9, step_weight=0.0)
    assert np.any(np.abs(want - episode_only)[cols["uid"] == "ga"] > 1e-3)
    # without the published inputs verl's path cannot run GiGPO, and says which trainer mode supplies them
    with pytest.raises(ValueError, match="trainer_mode=embodistill_gigpo"):
        compute_advantage(data, adv_estimator="gigpo", config=algorithm_config())


def test_keyword_and_non_tensor_batch_inputs_and_settings():
    cols, rewards, mask, lengths = hand_batch(with_pad=False)
    fn = plugin.compute_gigpo_advantage
    # norm_adv_by_std_in_grpo=False is the "mean" normalization; explicit arguments override the config
    adv, _ = fn(rewards, mask, index=cols["uid"], config=algorithm_config(norm_adv_by_std_in_grpo=False),
                traj_uid=cols["traj_uid"], step_idx=cols["step_idx"], anchor_key=cols["anchor_key"],
                step_reward=cols["step_reward"], step_weight=2.0)
    check_broadcast(adv, expected(cols, gamma=0.9, step_weight=2.0, normalize="mean"), lengths)
    # columns of non_tensor_batch (object arrays, as verl keeps them), uid standing in for index; no config:
    # the project's defaults (rl.config.GiGPOConfig)
    ntb = {k: np.array(list(cols[k]), dtype=object) for k in ("uid", "traj_uid", "step_idx", "anchor_key",
                                                               "step_reward")}
    adv, _ = fn(rewards, mask, non_tensor_batch=ntb)
    check_broadcast(adv, expected(cols, gamma=0.95, step_weight=1.0, normalize="mean_std"), lengths)


def test_returns_that_differ_within_a_trajectory_are_an_error():
    cols, rewards, mask, _ = hand_batch(with_pad=False)
    rewards = rewards.clone()
    rewards[0, 0] += 0.5   # as a per-token KL penalty in the reward would do
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        plugin.compute_gigpo_advantage(rewards, mask, index=cols["uid"], traj_uid=cols["traj_uid"],
                                       step_idx=cols["step_idx"], anchor_key=cols["anchor_key"],
                                       step_reward=cols["step_reward"])


# ------------------------------------------------------------------------------------------------ the trainer mode


class MemoryTransferQueue:
    """kv_batch_get / kv_batch_put over rows held in memory, returning TensorDicts as verl builds them."""

    def __init__(self, rows: dict[str, dict]):
        self.rows = rows

    def kv_batch_get(self, keys, partition_id, select_fields):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        return list_of_dict_to_tensordict([{f: self.rows[k][f] for f in select_fields if f in self.rows[k]}
                                           for k in keys])

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        for name in fields.keys():
            value = fields[name]
            values = value.unbind() if getattr(value, "is_nested", False) else list(value)
            for k, v in zip(keys, values, strict=True):
                self.rows[k][name] = v


def test_trainer_mode_feeds_the_estimator_from_row_keys_and_extra_fields(monkeypatch):
    pytest.importorskip("transfer_queue")
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base
    plugin.register()
    cols, _, _, lengths = hand_batch()
    store, keys = {}, []
    for i, length in enumerate(lengths):
        uid, session = cols["traj_uid"][i].split("_")
        key = f"{uid}_{session}_{cols['step_idx'][i]}"
        rm = torch.zeros(max(length, 1))
        rm[-1] = float(cols["ret"][i]) if length else 0.0
        store[key] = {"uid": uid, "response_mask": (torch.arange(max(length, 1)) < length).long(), "rm_scores": rm,
                      # as the agent loop writes them; the trainer must take trajectory and step from the key
                      "extra_fields": {"anchor_key": cols["anchor_key"][i], "step_reward": cols["step_reward"][i],
                                       "traj_uid": "ignored", "step_idx": -1}}
        keys.append(key)
    monkeypatch.setattr(trainer_base, "tq", MemoryTransferQueue(store))
    trainer = object.__new__(plugin.VerlGiGPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": algorithm_config(rollout_correction=None),
                                       "actor_rollout_ref": {"rollout": {"n": 3}}, "gigpo": {"step_weight": 0.5}})
    metrics: dict = {}
    trainer._compute_advantage(KVBatchMeta(keys=keys, tags=[{}] * len(keys), partition_id="train"), metrics)
    want = expected(cols, gamma=0.9, step_weight=0.5, normalize="mean_std")
    for i, key in enumerate(keys):
        got = store[key]["advantages"]
        length = max(lengths[i], 1)
        assert torch.equal(got, torch.full((length,), float(np.float32(want[i]))) * store[key]["response_mask"])
    # step groups: ga {1, 2, 3, 4, 5}, gb {1, 6, 7}, gc {8, 9}, the padding row {1}; 7 of them hold one row
    assert metrics["gigpo/num_step_groups"] == 11 and metrics["gigpo/frac_size1_step_groups"] == pytest.approx(7 / 11)


def test_step_inputs_from_rows_reads_verls_keys():
    got = plugin.step_inputs_from_rows(["u-1_0_0", "u-1_0_1", "u-1_3_0"],
                                       [{"anchor_key": "a", "step_reward": 1}, {"anchor_key": "b", "step_reward": 0},
                                        type("Wrapped", (), {"data": {"anchor_key": "a", "step_reward": 0.5}})()])
    assert got["uid"].tolist() == ["u-1"] * 3 and got["traj_uid"].tolist() == ["u-1_0", "u-1_0", "u-1_3"]
    assert got["step_idx"].tolist() == [0, 1, 0] and got["step_reward"].tolist() == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="anchor_key"):
        plugin.step_inputs_from_rows(["u_0_0"], [{}])


# ------------------------------------------------------------------------------------------------ the agent loop


SCRIPT = ['I look around first.\n<tool_call>{"name": "look_around", "arguments": {}}</tool_call>',
          "I am not sure what to do.",   # unreadable: the state does not change
          '<tool_call>{"name": "navigate", "arguments": {"target": "kitchen"}}</tool_call>',
          '<tool_call>{"name": "look_around", "arguments": {}}</tool_call>']


class ScriptedServer:
    """Stands in for verl's LLMServerClient: returns the script's token ids (plus the stop token) in order."""

    def __init__(self, tok, eos: int):
        self.tok, self.eos, self.calls = tok, eos, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput
        text = SCRIPT[len(self.calls) % len(SCRIPT)]
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "response_ids": ids})
        return TokenOutput(token_ids=ids, log_probs=[-0.25] * len(ids), num_preempted=0,
                           extra_fields={"min_global_steps": 3, "max_global_steps": 3})


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from agent.prompt import StepMemory, build_step_messages
    from sandbox.gym_env import SandboxEnv
    from sandbox.schema import TaskInstance
    from sft.student import train_tokenizer
    from conftest import world_dict
    env = SandboxEnv()
    obs, info = env.reset(seed=0, options={"task": TaskInstance.model_validate(world_dict())})
    msgs = build_step_messages(env.task.instruction, info["known"], StepMemory(), obs, 0, env.task.step_budget)
    texts = [m["content"] for m in msgs] * 3 + SCRIPT * 3
    tok = train_tokenizer(texts, vocab_size=400)
    folder = tmp_path_factory.mktemp("tiny_tok")
    tok.save_pretrained(folder)
    return tok, folder


def _make_loop(tok, folder, server):
    """The agent loop as verl's AgentLoopWorker makes it: hydra.utils.instantiate of the shipped
    agent-loop config entry, with the worker's keyword arguments (the ci recipe instead of the GPU one), in a
    process set up by the worker hook `pipeline.verl.register`."""
    import hydra

    import pipeline.verl
    pipeline.verl.register()
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset
    entries = OmegaConf.load(ROOT / "recipes" / "gpu" / "verl_agent_loops.yaml")
    entry = [e for e in entries if e.name == plugin.AGENT_LOOP_NAME][0]
    entry.recipe = "recipes/ci.yaml"
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 4096, "response_length": 64},
                                                     "model": {"path": str(folder)}}})
    return hydra.utils.instantiate(config=entry, trainer_config=DictConfigWrap(config), server_manager=server,
                                   tokenizer=tok, processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
                                   data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([]))


def _replay(task, seed: int, tok, recipe):
    """The same scripted episode through the project's own episode loop and rewards: the reference."""
    from agent.episode import Reply, play
    from agent.tools import tool_definitions
    from pipeline.stages import make_reward_engine
    from rl.rollout import RolloutBatch, StepSample
    from rl.trainer import rollout_rewards
    from sandbox.gym_env import SandboxEnv
    prompts = []

    class Script:
        name, reads_prompt = "student", True

        def start(self, episode, env, seed):
            pass

        def act(self, requests):
            text = tok.apply_chat_template(requests[0].messages, tools=tool_definitions(), add_generation_prompt=True,
                                           tokenize=False)
            prompts.append(tok(text, add_special_tokens=False)["input_ids"])
            return [Reply(text=SCRIPT[len(prompts) - 1])]

    played = play(SandboxEnv, Script(), [({"task": task}, seed)], memory_size=recipe.rl.memory_size,
                  max_steps=recipe.rl.max_steps)
    traj, episode = played.trajectories[0], played.episodes[0]
    samples = [StepSample(traj=0, step=k, anchor=a, prompt_ids=[], response_ids=[], logprobs=[])
               for k, a in enumerate(episode.anchors)]
    verdict = make_reward_engine(recipe).score(traj)
    rw = rollout_rewards(RolloutBatch(trajectories=[traj], groups=[0], samples=samples), [verdict], recipe.rl.reward)
    return [s.anchor for s in samples], prompts, rw


def test_agent_loop_plays_one_episode_with_a_scripted_server(tiny_tokenizer):
    from pipeline.recipe import load_recipe
    from sandbox.schema import TaskInstance
    from conftest import world_dict
    tok, folder = tiny_tokenizer
    recipe = load_recipe(ROOT / "recipes" / "ci.yaml")
    task = TaskInstance.model_validate(copy.deepcopy(world_dict()))
    row = {"task": task.model_dump_json(), "uid": "u-7", "index": 3, "global_steps": 5, "raw_prompt": [],
           "data_source": "embodistill/ci"}
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def play(session: int):
        server = ScriptedServer(tok, tok.eos_token_id)
        loop = _make_loop(tok, folder, server)
        return await loop.run(dict(sampling), session_id=session, **row), server

    (out0, server0), (out1, _) = asyncio.run(play(0)), asyncio.run(play(1))
    seed = plugin.episode_seed(task.id, 3, 5, recipe.seed)
    anchors, prompts, rw = _replay(task, seed, tok, recipe)

    assert len(out0) == len(SCRIPT) == recipe.rl.max_steps      # truncated at rl.max_steps, one row per step
    assert len({c["request_id"] for c in server0.calls}) == 1    # one sticky request id per episode
    for k, (o, call) in enumerate(zip(out0, server0.calls, strict=True)):
        assert o.prompt_ids == call["prompt_ids"] == prompts[k]  # what the server saw = the project's encoding
        assert o.response_ids == call["response_ids"]            # token out, as generated (stop token kept)
        assert o.response_mask == [1] * len(o.response_ids) and o.response_logprobs == [-0.25] * len(o.response_ids)
        ef = o.extra_fields
        assert (ef["traj_uid"], ef["step_idx"], ef["anchor_key"]) == ("u-7_0", k, anchors[k])
        assert ef["step_reward"] == pytest.approx(rw["step_rewards"][k])
        assert o.reward_score == pytest.approx(rw["traj_return"][0])
        d = o.as_dict()                                          # what verl's v1 worker stores per row
        assert d["rm_scores"][-1].item() == pytest.approx(o.reward_score) and d["responses"].tolist() == o.response_ids
    assert out0[2].extra_fields["anchor_key"] == out0[1].extra_fields["anchor_key"]   # the unreadable step
    assert out0[-1].extra_fields["reward_extra_info"]["num_steps"] == len(SCRIPT)
    # the other session of the prompt starts from the same state, with its own trajectory id
    assert out1[0].extra_fields["anchor_key"] == anchors[0] and out1[0].extra_fields["traj_uid"] == "u-7_1"

    # and on to the estimator, as the trainer mode hands it verl's rows
    rows = out0 + out1
    keys = [f"{o.extra_fields['traj_uid']}_{o.extra_fields['step_idx']}" for o in rows]
    inputs = plugin.step_inputs_from_rows(keys, [o.extra_fields for o in rows])
    width = max(len(o.response_ids) for o in rows)
    rewards = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, o in enumerate(rows):
        mask[i, : len(o.response_ids)] = 1
        rewards[i, len(o.response_ids) - 1] = o.reward_score
    with plugin.published_step_inputs(inputs):
        adv, _ = plugin.compute_gigpo_advantage(rewards, mask, index=inputs["uid"])
    want = compute_gigpo_advantages(inputs["uid"], inputs["traj_uid"], inputs["step_idx"], inputs["anchor_key"],
                                    inputs["step_reward"], rewards.sum(-1).double().numpy())
    assert torch.equal(adv, torch.as_tensor(want, dtype=torch.float32).unsqueeze(-1) * mask)


def test_dataset_rows_carry_the_task_and_the_agent_name(task):
    from pipeline.recipe import load_recipe
    from sandbox.schema import TaskInstance
    recipe = load_recipe(ROOT / "recipes" / "ci.yaml")
    rows = plugin.dataset_rows([task, task], "train", "embodistill/ci", recipe.rl.memory_size)
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]
    r = rows[0]
    assert r["agent_name"] == plugin.AGENT_LOOP_NAME and TaskInstance.model_validate_json(r["task"]) == task
    assert r["prompt"][0]["role"] == "system" and task.instruction in r["prompt"][-1]["content"]


# ------------------------------------------------------------------------------------------------ the verl config


def test_the_shipped_verl_config_composes_and_passes_verls_checks():
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    gpu = ROOT / "recipes" / "gpu"
    with initialize_config_dir(config_dir=str(gpu), version_base=None):
        cfg = compose(config_name="verl_gigpo", overrides=[
            f"data.train_files={ROOT}/data/train.parquet", f"data.val_files={ROOT}/data/val.parquet",
            f"actor_rollout_ref.model.path={ROOT}/outputs/qwen2.5-1.5b-gigpo/sft/final",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={gpu}/verl_agent_loops.yaml",
            f"trainer.default_local_dir={ROOT}/outputs/qwen2.5-1.5b-gigpo/rl/verl-gigpo"])
    assert not need_critic(cfg) and need_reference_policy(cfg)        # GiGPO has no critic; the KL loss a ref
    validate_config(config=cfg, use_reference_policy=True, use_critic=False)
    OmegaConf.resolve(cfg)
    algo = omega_conf_to_dataclass(cfg.algorithm)                       # verl's AlgoConfig takes it as it is
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert algo.adv_estimator == plugin.ESTIMATOR_NAME and not algo.use_kl_in_reward
    assert cfg.trainer.v1.trainer_mode == plugin.TRAINER_MODE and cfg.trainer.use_v1
    assert rollout.name == "vllm" and rollout.n == 8 and rollout.agent.default_agent_loop == plugin.AGENT_LOOP_NAME
    assert cfg.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == "pipeline.verl.register"
    entries = OmegaConf.load(rollout.agent.agent_loop_config_path)
    assert [e.name for e in entries] == [plugin.AGENT_LOOP_NAME]
    from pipeline.verl import resolve_recipe
    assert resolve_recipe(entries[0].recipe).is_file()
    # the settings the trainer mode hands the estimator
    assert plugin.gigpo_settings(cfg.algorithm, step_weight=cfg.gigpo.step_weight, eps=cfg.gigpo.eps) == \
        {"gamma": 0.95, "step_weight": 1.0, "normalize": "mean_std", "eps": 1e-6}


def _readme_command(marker: str) -> list[str]:
    """The overrides of the README's verl command whose block contains `marker`, with $PWD as the repo root."""
    import re
    import shlex
    text = (ROOT / "recipes" / "gpu" / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "verl.trainer.main_ppo" in b]
    block = [b for b in blocks if marker in b][0]
    words = shlex.split(re.sub(r"`#[^`]*`", "", block).replace("\\\n", " ").replace("$PWD", str(ROOT)))
    return words[words.index("verl.trainer.main_ppo") + 1:]


def test_the_readme_command_lines_give_the_config_file():
    from hydra import compose, initialize_config_dir, initialize_config_module
    with_file = _readme_command("--config-name=verl_gigpo")
    plain = _readme_command("worker_process_setup_hook")
    args = [w for w in with_file if not w.startswith("--")]
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "gpu"), version_base=None):
        a = compose(config_name="verl_gigpo", overrides=args)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        b = compose(config_name="ppo_trainer", overrides=plain)
    assert OmegaConf.to_container(a) == OmegaConf.to_container(b)


def test_the_dataset_reads_through_verls_dataset_into_the_agent_loop(tiny_tokenizer, tmp_path):
    """`embodistill verl-data` -> verl's RLHFDataset and collate_fn -> the v1 TensorDict a trainer step
    submits (uid added) -> one sample's keyword arguments as verl's agent-loop worker unpacks them -> run()."""
    from tensordict import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    tok, folder = tiny_tokenizer
    from pipeline.cli import main
    assert main(["verl-data", str(ROOT / "recipes" / "ci.yaml"), "--out", str(tmp_path), "--quiet"]) == 0
    data_cfg = OmegaConf.create({"max_prompt_length": 4096, "filter_overlong_prompts": True, "truncation": "error",
                                 "filter_overlong_prompts_workers": 1})
    ds = RLHFDataset(str(tmp_path / "train.parquet"), tok, data_cfg)
    batch = collate_fn([ds[0], ds[1]])
    batch["uid"] = np.array(["u-a", "u-b"], dtype=object)
    td = tu.get_tensordict(batch)
    tu.assign_non_tensor_data(td, "global_steps", 1)
    prompt = {}
    for k, v in td.items():
        prompt[k] = v[1] if isinstance(v, torch.Tensor) else v[1].data if isinstance(v, NonTensorStack) else \
            v.data if isinstance(v, NonTensorData) else v
    assert prompt.pop("agent_name") == plugin.AGENT_LOOP_NAME and int(prompt["index"]) == 1

    async def play():
        server = ScriptedServer(tok, tok.eos_token_id)
        return await _make_loop(tok, folder, server).run({"temperature": 1.0}, session_id=2, **prompt)

    out = asyncio.run(play())
    assert [o.extra_fields["step_idx"] for o in out] == list(range(len(out))) and 1 <= len(out) <= 4
    assert out[0].extra_fields["traj_uid"] == "u-b_2"
    assert out[0].extra_fields["task_id"] == plugin._task_of(prompt["task"]).id
