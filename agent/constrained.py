"""Constrained decoding of compact skill calls: a model can only write a well-formed call whose id arguments are
ids its own prompt lists as known.

A tiny student renders a call compactly (`<tool_call>place yellow_ball|yellow_box</tool_call>`, see
`agent.parser.parse_compact`). Unconstrained, a small model sometimes writes an id that is not in its prompt
(`yellow_ball` for the yellow box it was shown) or degenerates (`navigate blue blue blue ...`), and the sandbox
answers `unknown_entity` or `parse_error`. Allowed any word of its prompt, a tiny TextWorld student copied
prose (`pick_up been` out of an echoed error, `pick_up Places`) and walked to the room it stood in, call after
call. `CallConstraint` masks, at every generated token, the tokens that cannot continue a valid call:

- first `<tool_call>` (with `think`, any text before it: a student trained with reasoning writes it first);
- the skill name: one of `sandbox.skills.SKILLS`;
- each argument, in the skill's parameter order, after optional spaces: for an enum parameter one of its
  values in the tools the batch was given (TextWorld's `operate` actions; the sandbox's by default); for an id
  parameter (its description starts with "id") an id the row's prompt lists as known (`agent.prompt.known_ids`:
  the words of its `At:`, `Places:`, `Doors:`, `Unvisited:`, `Objects:`, `People:`, `Facts:` and `Task
  objects:` lines, the arguments of recent calls that worked and ids in brackets; not the prose of the task, the
  observation, the recent results or the system message), for `navigate` not the place the agent is at, and for
  an argument whose description names no place (`pick_up`'s object, `open`'s door or container, `inspect`'s
  object or door, `operate`'s device) no place (`agent.prompt.place_ids`: a TextWorld student wrote `pick_up
  recreation_zone_north`, an exit, 241 times in 200 validation games); any
  other parameter (and a `talk_to` topic, which may be a fact's id) free text without `|` or `<`;
- not a one-id call that failed since the last call that worked (`pick_up bug` after `pick_up(bug) ->
  precondition_unmet`), unless a sandbox failure trigger fired (`RETRYABLE`): 57 of a TextWorld student's 69
  lost validation games repeated such a call until the budget ran out;
- `|` between arguments, `</tool_call>` after a complete argument (or the name), then only the end token.

It reads nothing but the prompt the model is given (no env state) and executes nothing; it works on the text of
the tokens, so any tokenizer whose vocabulary has `<tool_call>` and `</tool_call>` as single tokens qualifies.
The check walks each candidate token's characters from the row's state, so its cost grows with the vocabulary:
meant for the tiny student (hundreds of tokens); `max_vocab` refuses a large one instead of crawling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from agent.prompt import known_ids, place_ids, recent_calls

# states: (phase, skill, param index, trie node or text length)
_PRE, _NAME, _AFTER_NAME, _ARG, _CLOSED = range(5)
_END = "\0"   # marks a complete word in a trie
# what a constrained call may name; a cached evaluation keyed by it is not read back under other rules (change it
# when they change: "prompt-words" was any word of the prompt, before 2026-12-07)
RULES = "known-ids+tool-enums+no-walk-to-here+no-repeat-of-failed-calls+no-place-for-a-thing"
# id parameters whose value need not be on the prompt: a talk_to topic may be a fact the teacher names by its id
_FREE_IDS = {("talk_to", "topic")}
# the one failure worth retrying as it was: a sandbox failure trigger that fired (a slip, a stuck door) may not fire
# again; any other failed call fails again the same way, as the state it failed in is unchanged
RETRYABLE = frozenset({"trigger_fired"})


class _Ids(NamedTuple):
    """One row's tries: every known id, the ids `navigate` may name (not the place the agent is at: walking to
    where it stands does nothing, and a student stuck in that loop never leaves), the ids that name no place,
    each enum parameter's values in the tools the row was given (TextWorld's `operate` takes eat, cook, lock,
    ...), and for each skill of a call that failed since the last that worked, its ids without the ones those
    calls named (`retry`: {(skill, 0): trie}; see `ids_trie`)."""
    any: dict
    navigate: dict
    things: dict   # known ids that name no place (`agent.prompt.place_ids`): for an argument that is no place
    enums: dict
    retry: dict
    names: dict   # the skills the row can call: not one whose first argument must be an id and none is left


def _trie(words) -> dict:
    root: dict = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[_END] = {}
    return root


@dataclass(frozen=True)
class _State:
    phase: int
    skill: str = ""
    param: int = 0
    node: object = None      # trie node (name, id or enum argument) or None
    started: bool = False    # the argument has a character that is not a leading space


class CallConstraint:
    """Per-tokenizer tables; `processor(prompt_texts, width)` gives the logits processor for one batch."""

    def __init__(self, tokenizer, think: bool = False, max_vocab: int = 20_000):
        from sandbox.skills import SKILLS
        n = len(tokenizer)
        if n > max_vocab:
            raise ValueError(f"constrained decoding checks every token's text per step; this vocabulary has {n} "
                             f"tokens (max_vocab {max_vocab}): it is meant for a tiny student")
        ids = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
        unk = tokenizer.unk_token_id
        if any(i is None or i == unk for i in ids):
            raise ValueError("constrained decoding needs <tool_call> and </tool_call> as single tokens "
                             "(the tiny student's tokenizer has them)")
        self.open_id, self.close_id = ids
        self.think = think
        self.end_ids = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|end|>"))
                        if i is not None and i != unk}
        if not self.end_ids:
            raise ValueError("constrained decoding needs an end token (eos)")
        special = set(tokenizer.all_special_ids)
        # the text of each ordinary token (decoded alone: a word-start token keeps its leading space)
        self.text = {}
        for t in range(n):
            if t in special:
                continue
            s = tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if s:
                self.text[t] = s
        self.by_first: dict[str, list[int]] = {}
        for t, s in self.text.items():
            self.by_first.setdefault(s[0], []).append(t)
        self.skills = SKILLS
        self._enums_of: dict[str, dict] = {}
        self.id_params = {(name, i) for name, sk in SKILLS.items() for i, p in enumerate(sk.params)
                          if not p.enum and p.description.startswith("id") and (name, p.name) not in _FREE_IDS}
        # id arguments that never name a place (their description does not say "place": pick_up's object,
        # open's door or container, inspect's object or door, operate's device, a person)
        self.thing_params = {(name, i) for name, i in self.id_params
                             if "place" not in SKILLS[name].params[i].description}
        # skills whose one argument is an id (navigate, inspect, pick_up, open, close): a failed call of one is
        # not repeated (`ids_trie`)
        self.one_id = {name for name, sk in SKILLS.items() if len(sk.params) == 1 and (name, 0) in self.id_params}

    # ------------------------------------------------------------------ the character machine

    def _arg_start(self, skill: str, i: int, ids: _Ids) -> _State:
        if (skill, i) in ids.retry:
            return _State(_ARG, skill, i, ids.retry[(skill, i)])
        if (skill, i) in ids.enums:
            return _State(_ARG, skill, i, ids.enums[(skill, i)])
        if (skill, i) in self.id_params:
            trie = ids.navigate if skill == "navigate" else ids.things if (skill, i) in self.thing_params else ids.any
            return _State(_ARG, skill, i, trie)
        return _State(_ARG, skill, i, None)

    def _char(self, st: _State, ch: str, ids: _Ids) -> _State | None:
        if st.phase == _NAME:
            nxt = st.node.get(ch)
            if nxt is not None:
                return _State(_NAME, node=nxt, skill=st.skill + ch)
            if ch == " " and _END in st.node and self.skills[st.skill].params:
                return self._arg_start(st.skill, 0, ids)
            return None
        if st.phase == _ARG:
            if ch == " " and not st.started:
                return st
            if ch == "|":
                done = st.started and (st.node is None or _END in st.node)
                if done and st.param + 1 < len(self.skills[st.skill].params):
                    return self._arg_start(st.skill, st.param + 1, ids)
                return None
            if st.node is None:   # free text
                return None if ch in "<\n" else _State(_ARG, st.skill, st.param, None, True)
            nxt = st.node.get(ch)
            return None if nxt is None or ch == _END else _State(_ARG, st.skill, st.param, nxt, True)
        return None

    def _closable(self, st: _State) -> bool:
        """A call can end after its name or a complete argument when no required parameter is left."""
        if st.phase == _NAME:
            return _END in st.node and not any(p.required for p in self.skills[st.skill].params)
        if st.phase == _ARG:
            rest = self.skills[st.skill].params[st.param + 1:]
            return st.started and (st.node is None or _END in st.node) and not any(p.required for p in rest)
        return False

    def step(self, st: _State, token: int, ids: _Ids) -> _State | None:
        """The state after one generated token, or None when it cannot continue a valid call."""
        if st.phase == _PRE:
            if token == self.open_id:
                return _State(_NAME, node=ids.names)
            return st if self.think and token in self.text else None
        if st.phase == _CLOSED:
            return None
        if token == self.close_id:
            return _State(_CLOSED) if self._closable(st) else None
        s = self.text.get(token)
        if s is None:
            return None
        for ch in s:
            st = self._char(st, ch, ids)
            if st is None:
                return None
        return st

    def allowed(self, st: _State, ids: _Ids) -> list[int]:
        if st.phase == _PRE:
            return [self.open_id, *self.text] if self.think else [self.open_id]
        if st.phase == _CLOSED:
            return sorted(self.end_ids)
        out = [self.close_id] if self._closable(st) else []
        for first in self._first_chars(st, ids):
            for t in self.by_first.get(first, ()):
                if self.step(st, t, ids) is not None:
                    out.append(t)
        return out

    def _first_chars(self, st: _State, ids: _Ids):
        if st.phase == _NAME:
            return [c for c in st.node if c != _END] + ([" "] if _END in st.node else [])
        if st.node is None:   # free text: anything but the separator and markup
            return [c for c in self.by_first if c not in "<\n"]
        return [c for c in st.node if c != _END] + [" ", "|"]

    # ------------------------------------------------------------------ the batch

    def enums(self, tools: list[dict] | None) -> dict:
        """The enum tries of a `tools` list (OpenAI function schemas, in the skills' parameter order); without
        one, the sandbox's tools (`agent.tools.tool_definitions`)."""
        from agent.tools import tool_definitions
        tools = tool_definitions() if tools is None else tools
        key = json.dumps(tools, sort_keys=True)
        if key not in self._enums_of:
            out = {}
            for t in tools:
                name = t["function"]["name"]
                if name not in self.skills:
                    continue
                props = t["function"]["parameters"]["properties"]
                for i, p in enumerate(self.skills[name].params):
                    if "enum" in props.get(p.name, {}):
                        out[(name, i)] = _trie(props[p.name]["enum"])
            self._enums_of[key] = out
        return self._enums_of[key]

    def ids_trie(self, prompt_text: str, tools: list[dict] | None = None) -> _Ids:
        """The row's tries. A one-id call (`pick_up bug`, `open portal`, `navigate cellar`) that failed since the
        last call that worked (`agent.prompt.recent_calls`), with an error that is not `RETRYABLE`, is not allowed
        again now: a failed call changes nothing but, for a walk, where the agent stands, so the state it failed in
        is the state now and it would fail the same way (a walk again at the same closed way); a greedy student
        that repeats it once repeats it to the end of its budget. Calls older than a failed walk are not held
        against it."""
        ids, here = known_ids(prompt_text)
        walk, things = ids - {here}, ids - place_ids(prompt_text)
        failed: dict[str, set[str]] = {}
        for call in reversed(recent_calls(prompt_text)):
            if call is None:               # an unreadable output: the env saw nothing
                continue
            skill, args, result = call
            if result == "ok" or result in RETRYABLE:
                break
            if skill in self.one_id and len(args) == 1:
                failed.setdefault(skill, set()).add(args[0])
            if skill == "navigate":        # a walk can fail on its way (a locked door) where it stood: older failed
                break                      # calls may have failed only for where the agent was
        retry = {(skill, 0): _trie((walk if skill == "navigate" else things if (skill, 0) in self.thing_params
                                    else ids) - names) for skill, names in failed.items()}
        row = _Ids(_trie(ids), _trie(walk), _trie(things), self.enums(tools), retry, {})
        callable_ = [name for name, sk in self.skills.items()
                     if not (sk.params and sk.params[0].required and self._arg_start(name, 0, row).node == {})]
        return row._replace(names=_trie(callable_))

    def processor(self, prompt_texts: list[str], width: int, tools: list[dict] | None = None):
        """A transformers `LogitsProcessor` for one batch: row b's prompt text is `prompt_texts[b]`, and its
        generated tokens start at column `width` of the (left-padded) input ids. `tools`: the tool schemas the
        batch was given (their enums: `enums`)."""
        import torch
        from transformers import LogitsProcessor

        tries = [self.ids_trie(t, tools) for t in prompt_texts]
        states = [_State(_PRE) for _ in prompt_texts]
        seen = [0] * len(prompt_texts)
        machine = self
        # the allowed tokens depend on the state and the row's ids (a token can run from a skill name or an enum
        # value into the row's next id argument): a row's steps in the same state share one walk over the
        # vocabulary (the tries live as long as this batch, so their ids are stable keys)
        memo: dict = {}

        def allowed(b: int) -> list[int]:
            st = states[b]
            if st is None:
                return sorted(machine.end_ids)
            key = (id(tries[b]), st.phase, st.skill, st.param, id(st.node), st.started)
            if key not in memo:
                memo[key] = machine.allowed(st, tries[b]) or sorted(machine.end_ids)
            return memo[key]

        class _Mask(LogitsProcessor):
            def __call__(self, input_ids, scores):
                mask = torch.full_like(scores, float("-inf"))
                for b in range(input_ids.shape[0]):
                    gen = input_ids[b, width:].tolist()
                    for tok in gen[seen[b]:]:
                        # a row already past its end (other rows still generating) stays closed
                        nxt = machine.step(states[b], tok, tries[b]) if states[b] is not None else None
                        states[b] = nxt
                    seen[b] = len(gen)
                    mask[b, allowed(b)] = 0.0
                return scores + mask

        return _Mask()
