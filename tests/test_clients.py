"""Model clients against real backends: OpenAIClient against a loopback OpenAI-compatible server (the real
SDK over real HTTP), TransformersClient with a tiny Llama trained here; and the episode loop's policies over
them: a chat model (ChatPolicy) and the scripted expert answering as a model would (same calls and success as
the expert acting on calls)."""

from __future__ import annotations

import json
import logging
import socket
import threading

import pytest
from pydantic import ValidationError

from agent.clients import OpenAIClient, TransformersClient, tool_call_text
from agent.episode import play
from agent.models import ChatModel, ChatReply, ModelError
from agent.parser import ParseError, ToolCall, render_tool_call
from agent.prompt import StepMemory, build_step_messages
from agent.tools import tool_definitions
from agent.policies import ChatPolicy, ScriptedPolicy
from sandbox.agents import ExpertAgent
from sandbox.controller import EnvController
from sandbox.gym_env import SandboxEnv
from sandbox.observation import known_map

from fake_openai import Delay, FakeOpenAI, Garbage, Reply, Status

MSGS = [{"role": "user", "content": "Go to the kitchen."}]
NAV = {"name": "navigate", "arguments": {"target": "kitchen"}}


def client(server: FakeOpenAI, **kw) -> OpenAIClient:
    kw.setdefault("backoff", 0.01)
    kw.setdefault("api_key_env", "EMBODISTILL_TEST_KEY_UNSET")
    return OpenAIClient("fake-model", base_url=server.base_url, **kw)


# ============================================================================ OpenAIClient: replies


def test_reply_text_tool_calls_and_reasoning_parse_through_the_shared_parser():
    answers = [Reply("I go.\n" + render_tool_call(**NAV)), Reply("", tool_calls=[NAV], reasoning="kitchen first"),
               Reply("no call here")]
    with FakeOpenAI(lambda body, n: answers[n]) as server:
        c = client(server)
        text, calls, plain = (c.chat(MSGS) for _ in range(3))
    assert isinstance(c, ChatModel) and server.errors == []
    assert text.action() == ToolCall("navigate", {"target": "kitchen"}, "I go.")
    assert text.model == "fake-model"
    assert text.usage == {"prompt_tokens": 4, "completion_tokens": len(text.text.split())}  # the server's counts
    assert calls.text == "" and calls.reasoning == "kitchen first"
    assert calls.tool_calls == [{"name": "navigate", "arguments": '{"target": "kitchen"}'}]
    assert calls.action() == ToolCall("navigate", {"target": "kitchen"}, "kitchen first")
    assert isinstance(plain.action(), ParseError)


def test_request_parameters_reach_the_server():
    with FakeOpenAI(lambda body, n: Reply("{}")) as server:
        c = client(server, temperature=0.3, seed=11, max_tokens=64, extra_body={"top_k": 5})
        c.chat(MSGS)
        c.chat(MSGS, tools=tool_definitions(), temperature=0.9, seed=5, max_tokens=7, json_mode=True)
    first, second = server.requests
    assert first["model"] == "fake-model" and first["messages"] == MSGS
    assert (first["temperature"], first["seed"], first["max_tokens"], first["top_k"]) == (0.3, 11, 64, 5)
    assert "tools" not in first and "response_format" not in first
    assert (second["temperature"], second["seed"], second["max_tokens"]) == (0.9, 5, 7)
    assert second["tools"] == tool_definitions()
    assert second["response_format"] == {"type": "json_object"}


# ============================================================================ OpenAIClient: retries


@pytest.mark.parametrize("failure", [Status(500), Status(429), Status(503, "overloaded")])
def test_retries_server_errors_then_succeeds(failure):
    with FakeOpenAI(lambda body, n: failure if n < 2 else Reply("done")) as server:
        c = client(server, max_retries=3)
        reply = c.chat(MSGS)
    assert reply.text == "done"
    assert len(server.requests) == 3
    assert c.stats == {"requests": 3, "retries": 2, "errors_by_kind": {}}


def test_retries_a_timeout_then_succeeds():
    with FakeOpenAI(lambda body, n: Delay(1.0, Reply("late")) if n == 0 else Reply("on time")) as server:
        c = client(server, timeout=0.25, max_retries=1)
        assert c.chat(MSGS).text == "on time"
    assert len(server.requests) == 2 and c.stats["retries"] == 1


def test_no_retry_on_a_client_error():
    with FakeOpenAI(lambda body, n: Status(400)) as server:
        c = client(server, max_retries=3)
        with pytest.raises(ModelError) as e:
            c.chat(MSGS)
    assert (e.value.kind, e.value.attempts) == ("http", 1)
    assert "HTTP 400" in str(e.value)
    assert len(server.requests) == 1
    assert c.stats == {"requests": 1, "retries": 0, "errors_by_kind": {"http": 1}}


@pytest.mark.parametrize("answer,kind,retried", [(Status(502), "http", True),
                                                 (Delay(0.6, Reply("too late")), "timeout", True),
                                                 (Garbage("<html>proxy error</html>"), "bad_response", False),
                                                 (Garbage('{"object": "chat.completion"}'), "bad_response", False)])
def test_bounded_failure_gives_a_model_error_of_the_right_kind(answer, kind, retried):
    with FakeOpenAI(lambda body, n: answer) as server:
        c = client(server, timeout=0.2, max_retries=2)
        with pytest.raises(ModelError) as e:
            c.chat(MSGS)
    attempts = 3 if retried else 1
    assert (e.value.kind, e.value.attempts) == (kind, attempts)
    assert len(server.requests) == attempts
    assert c.stats["errors_by_kind"] == {kind: 1} and c.stats["retries"] == attempts - 1


def test_connection_refused_is_a_connection_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = OpenAIClient("m", base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, backoff=0.0,
                     api_key_env="EMBODISTILL_TEST_KEY_UNSET")
    with pytest.raises(ModelError) as e:
        c.chat(MSGS)
    assert (e.value.kind, e.value.attempts) == ("connection", 2)


def test_backoff_is_exponential_bounded_and_seeded():
    with FakeOpenAI(lambda body, n: Reply("")) as server:
        a, b, other = client(server, backoff=0.5, seed=3), client(server, backoff=0.5, seed=3), \
            client(server, backoff=0.5, seed=4)
    delays = [a.retry_delay(k) for k in range(6)]
    assert delays == [b.retry_delay(k) for k in range(6)]
    assert delays != [other.retry_delay(k) for k in range(6)]
    for k, d in enumerate(delays):
        assert 0.5 * 0.5 * 2 ** k <= d < min(30.0, 0.5 * 1.5 * 2 ** k) + 1e-9


# ============================================================================ OpenAIClient: concurrency


def test_chat_many_keeps_order_and_isolates_failures():
    def responder(body, n):
        text = body["messages"][-1]["content"]
        if text == "bad":
            return Status(400)
        # later prompts answer sooner, so completion order differs from request order
        return Delay(0.02 * (10 - int(text)), Reply(f"echo {text}"))

    prompts = [[{"role": "user", "content": str(i)}] for i in range(6)]
    prompts.insert(3, [{"role": "user", "content": "bad"}])
    with FakeOpenAI(responder) as server:
        c = client(server, max_concurrency=4)
        out = c.chat_many(prompts)
    assert [r.text if isinstance(r, ChatReply) else r.kind for r in out] == \
        ["echo 0", "echo 1", "echo 2", "http", "echo 3", "echo 4", "echo 5"]
    assert c.stats["requests"] == 7 and c.stats["errors_by_kind"] == {"http": 1}


def test_concurrency_limit_is_respected_on_the_server():
    with FakeOpenAI(lambda body, n: Delay(0.1, Reply("ok"))) as server:
        c = client(server, max_concurrency=3)
        out = c.chat_many([MSGS] * 9)
        assert server.max_in_flight == 3
        # the limit also holds across threads calling the same client
        server.max_in_flight = 0
        threads = [threading.Thread(target=c.chat_many, args=([MSGS] * 3,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert server.max_in_flight == 3
    assert all(r.text == "ok" for r in out)


# ============================================================================ OpenAIClient: the key


def test_the_key_is_sent_but_never_shown(monkeypatch, caplog):
    secret = "sk-test-do-not-print-4f2a9c"
    monkeypatch.setenv("EMBODISTILL_TEST_KEY", secret)
    echo = json.dumps({"error": {"message": f"Incorrect API key provided: {secret}"}})
    answers = [Status(500, echo), Reply("fine"), Status(401, echo)]
    with FakeOpenAI(lambda body, n: answers[n]) as server:
        c = OpenAIClient("m", base_url=server.base_url, api_key_env="EMBODISTILL_TEST_KEY", backoff=0.0)
        with caplog.at_level(logging.DEBUG):
            assert c.chat(MSGS).text == "fine"   # after one retry that logged the echoed error
            with pytest.raises(ModelError) as e:
                c.chat(MSGS)
    assert server.headers[0]["authorization"] == f"Bearer {secret}"
    assert "Incorrect API key" in str(e.value) and "***" in str(e.value)
    for text in (repr(c), str(c), str(e.value), repr(e.value), caplog.text, json.dumps(c.stats)):
        assert secret not in text
    assert "retry 1/3" in caplog.text


def test_missing_key_is_named_unless_the_server_is_local(monkeypatch):
    monkeypatch.delenv("EMBODISTILL_TEST_KEY_UNSET", raising=False)
    with pytest.raises(ValueError, match="EMBODISTILL_TEST_KEY_UNSET"):
        OpenAIClient("m", base_url="https://api.example.com/v1", api_key_env="EMBODISTILL_TEST_KEY_UNSET")
    with FakeOpenAI(lambda body, n: Reply("ok")) as server:
        client(server).chat(MSGS)
        OpenAIClient("m", base_url=server.base_url.replace("127.0.0.1", "localhost"),
                     api_key_env="EMBODISTILL_TEST_KEY_UNSET").chat(MSGS)
    assert [h["authorization"] for h in server.headers] == ["Bearer EMPTY", "Bearer EMPTY"]


def test_bad_settings_name_the_field():
    with pytest.raises(ValidationError, match="max_concurrency"):
        OpenAIClient("m", base_url="http://localhost:1/v1", max_concurrency=0)
    with pytest.raises(ValidationError, match="timeout"):
        OpenAIClient("m", base_url="http://localhost:1/v1", timeout=-1)


def test_tool_call_text_renders_openai_calls_as_markup():
    r = ChatReply(text="thinking", tool_calls=[{"name": "look_around", "arguments": "{}"}])
    assert tool_call_text(r) == "thinking\n" + render_tool_call("look_around", {})
    bad = ChatReply(text="", tool_calls=[{"name": "navigate", "arguments": "{oops"}])
    from agent.parser import parse_action
    assert parse_action(tool_call_text(bad)).message == bad.action().message


# ============================================================================ TransformersClient


TEMPLATE = (
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{%- endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
SPECIAL = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<tool_call>", "</tool_call>"]
TARGET = "I go to the kitchen.\n" + render_tool_call(**NAV)


def _corpus(task) -> list[str]:
    ctrl = EnvController(task)
    obs = ctrl.reset()
    texts = [json.dumps(tool_definitions()), TARGET]
    for call in ({"name": "look_around", "arguments": {}}, NAV, {"name": "search", "arguments": {"query": "cup"}}):
        msgs = build_step_messages(task.instruction, known_map(ctrl.world), StepMemory(), obs, ctrl.steps,
                                   task.step_budget)
        texts += [m["content"] for m in msgs]
        obs = ctrl.step(call).observation
    return texts


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, task):
    """A real tokenizer (BPE trained on sandbox text) and a tiny Llama taught one tool call, saved to disk."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_corpus(task), trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>",
                                  extra_special_tokens=SPECIAL[3:])
    tok.chat_template = TEMPLATE
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    prompt = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    t_ids = tok(TARGET, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p_ids + t_ids])
    labels = torch.tensor([[-100] * len(p_ids) + t_ids])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):  # memorise one completion, so greedy decoding must reproduce it exactly
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> TransformersClient:
    return TransformersClient(str(tiny_model_dir), max_new_tokens=40, batch_size=2)


def test_loads_by_path_and_speaks_the_protocol(local, tiny_model_dir):
    assert isinstance(local, ChatModel)
    assert local.name == tiny_model_dir.name
    with pytest.raises(FileNotFoundError, match="config.json"):
        TransformersClient(str(tiny_model_dir / "missing"))
    import torch
    assert TransformersClient(tiny_model_dir, dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="'float31' is not a torch dtype"):
        TransformersClient(tiny_model_dir, dtype="float31")


def test_the_prompt_is_the_chat_template(local):
    tools = tool_definitions()[:2]
    rendered = local.render_prompt(MSGS, tools)
    assert rendered == f"<|system|>Tools: {json.dumps(tools)}<|end|><|user|>Go to the kitchen.<|end|><|assistant|>"
    reply = local.chat(MSGS, tools=tools, max_tokens=3)
    assert reply.usage["prompt_tokens"] == len(local.tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_generates_the_taught_tool_call_with_special_token_markup(local):
    tok = local.tokenizer
    assert tok.convert_tokens_to_ids("<tool_call>") in tok.all_special_ids
    reply = local.chat(MSGS)
    assert reply.text == TARGET                      # decoded new tokens only, end token cut off
    assert reply.action() == ToolCall("navigate", {"target": "kitchen"}, "I go to the kitchen.")
    assert reply.usage["completion_tokens"] == len(tok(TARGET, add_special_tokens=False)["input_ids"])


def test_decode_keeps_special_markup_and_cuts_end_and_pad(local):
    tok = local.tokenizer
    ids = tok("<tool_call>x</tool_call>", add_special_tokens=False)["input_ids"]
    text, n = local.decode_new(ids + [tok.eos_token_id, tok.pad_token_id, tok.pad_token_id])
    assert (text, n) == ("<tool_call>x</tool_call>", len(ids))


def test_batched_greedy_equals_one_by_one(local):
    batch = [MSGS, [{"role": "user", "content": "Find the cup and report where it is."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Look."}]]
    one_by_one = [local.chat(m, max_tokens=12).text for m in batch]
    batched = local.chat_many(batch, max_tokens=12)  # batch_size 2: a padded pair, then one
    assert [r.text for r in batched] == one_by_one
    assert one_by_one[0] == local.chat(MSGS, max_tokens=12).text
    assert len({len(local.tokenizer(local.render_prompt(m))["input_ids"]) for m in batch}) == 3  # padding is used


def test_sampling_is_seeded_per_call_and_leaves_the_global_rng_alone(local):
    import torch
    state = torch.random.get_rng_state()
    prompt = [{"role": "user", "content": "Look."}]
    a = local.chat(prompt, temperature=1.5, seed=5, max_tokens=16).text
    b = local.chat(prompt, temperature=1.5, seed=5, max_tokens=16).text
    c = local.chat(prompt, temperature=1.5, seed=6, max_tokens=16).text
    assert a == b and a != c
    assert torch.equal(state, torch.random.get_rng_state())


# ============================================================================ the episode loop's policies


def test_the_expert_answering_as_a_model_equals_the_expert_acting_on_calls(built_tasks):
    starts = [({"task": t}, i) for i, t in enumerate(built_tasks)]
    a = play(SandboxEnv, ScriptedPolicy(ExpertAgent, name="expert"), starts).trajectories
    as_text = ScriptedPolicy(ExpertAgent, name="expert", as_text=True)
    b = play(SandboxEnv, as_text, starts, batch_size=7).trajectories
    for ta, tb, t in zip(a, b, built_tasks, strict=True):
        assert [x.tool_call for x in tb.turns] == [x.tool_call for x in ta.turns], t.id
        assert [x.reasoning for x in tb.turns] == [x.reasoning for x in ta.turns], t.id
        assert (tb.success, tb.subgoals_met) == (ta.success, ta.subgoals_met), t.id
        assert ta.success, t.id
        # as a model would: each turn keeps its step prompt and the text it wrote; the calls alone keep neither
        assert all(x.prompt[-1]["content"].endswith("Next skill call?") and "<tool_call>" in x.raw_output
                   for x in tb.turns)
        assert all(x.prompt == [] and x.raw_output is None for x in ta.turns)


def test_a_chat_model_over_http_sees_the_shared_prompt_and_its_unreadable_text_is_a_parse_error(built_tasks):
    task = built_tasks[0]
    answers = [Reply("", tool_calls=[{"name": "look_around", "arguments": {}}], reasoning="look first"),
               Reply("I am not sure what to do.")]
    env = SandboxEnv()
    with FakeOpenAI(lambda body, n: answers[min(n, 1)]) as server:
        played = play(lambda: env, ChatPolicy(client(server), name="fake"), [({"task": task}, 0)], max_steps=2)
    traj = played.trajectories[0]
    first, second = traj.turns
    assert (first.reasoning, first.tool_call) == ("look first", {"name": "look_around", "arguments": {}})
    obs, info = SandboxEnv().reset(seed=0, options={"task": task})
    assert first.prompt == build_step_messages(task.instruction, info["known"], StepMemory(), obs, 0,
                                               task.step_budget)
    assert second.raw_output == "I am not sure what to do." and second.reasoning == second.raw_output
    assert second.tool_call is None and second.error == "parse_error"
    assert second.observation.startswith("I could not read a skill call: no <tool_call> block")
    assert "look_around" in second.prompt[-1]["content"]  # the memory of the first step
    assert traj.truncated and len(traj.turns) == 2
    assert [r["tools"] for r in server.requests] == [tool_definitions()] * 2
    assert server.requests[0]["messages"] == first.prompt
    assert server.requests[0]["seed"] != server.requests[1]["seed"]  # seeded per step


def test_an_endpoint_that_fails_ends_its_episode_unrecorded_never_as_an_invalid_action(built_tasks):
    from agent.models import ModelError as Error
    tasks = list({t.instruction: t for t in built_tasks}.values())[:3]   # three instructions: one fails
    with FakeOpenAI(lambda body, n: Status(400) if "Task: " + tasks[1].instruction in
                    body["messages"][-1]["content"] else Reply("<tool_call>{\"name\": \"look_around\"}</tool_call>")
                    ) as server:
        policy = ChatPolicy(client(server, max_retries=0), name="fake")
        starts = [({"task": t}, i) for i, t in enumerate(tasks)]
        with pytest.raises(Error):
            play(SandboxEnv, policy, starts, max_steps=2)
        played = play(SandboxEnv, policy, starts, max_steps=2, raise_errors=False)
    assert [i for i, _ in played.errors] == [1] and played.episodes[1].trajectory.turns == []
    assert [len(played.episodes[i].trajectory.turns) for i in (0, 2)] == [2, 2]
