"""Token ids of tool turns, rendered with the tokenizer's chat template, to append after a model turn.

The model's sampled ids are never re-tokenized: a trajectory is prompt + turn 1's sampled ids + the template's tokens
for the tool responses and the next assistant header + turn 2's sampled ids + ... . The template's pieces are found
by rendering a fixed placeholder conversation with and without the tool messages and taking the text in between
(verl's delta rendering), so any template works whose assistant turn ends with the model's stop token.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

_PLACEHOLDER = [{"role": "user", "content": "U"}]
_ANSWER = "A"


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


class ChatRenderer:
    """Renders tool turns of one tokenizer (HF tokenizer with a chat template)."""

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int] = ()):
        self.tok = tokenizer
        eos = tokenizer.eos_token_id
        self.stop_ids = {int(t) for t in ([eos] if isinstance(eos, int) else list(eos or [])) + list(stop_token_ids)}
        base = self._render(_PLACEHOLDER + [{"role": "assistant", "content": _ANSWER}])
        header = self._render(_PLACEHOLDER, generation_prompt=True)
        if not base.startswith(header + _ANSWER):
            raise ValueError("the chat template does not render an assistant message as the generation prompt "
                             "followed by its content; multi-turn rollouts need such a template")
        self._base = base
        # what the template writes after an assistant message's content (e.g. '<|im_end|>\n' or '</s>')
        self.assistant_suffix = base[len(header) + len(_ANSWER):]

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return _ids(self.tok.encode(text, add_special_tokens=False)) if text else []

    def suffix_after(self, turn_ids: Sequence[int]) -> str:
        """Text the template puts after a model turn that ended with `turn_ids[-1]`: the assistant suffix less the
        stop token the model already sampled (when the suffix starts with it)."""
        if turn_ids and int(turn_ids[-1]) in self.stop_ids:
            stop_text = self.tok.decode([int(turn_ids[-1])], skip_special_tokens=False)
            if self.assistant_suffix.startswith(stop_text):
                return self.assistant_suffix[len(stop_text):]
        return self.assistant_suffix

    def tool_turn(self, turn_ids: Sequence[int], tool_texts: Sequence[str]) -> list[int]:
        """Ids to append after a model turn (`turn_ids`, as sampled): the rest of its assistant suffix, one tool message
        per response in `tool_texts`, and the next assistant generation prompt."""
        tools = [{"role": "tool", "content": t} for t in tool_texts]
        full = self._render(_PLACEHOLDER + [{"role": "assistant", "content": _ANSWER}] + tools, generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders an earlier assistant turn differently once tool messages "
                             "follow it; token-exact multi-turn rollouts need a template that does not")
        return self.encode(self.suffix_after(turn_ids) + full[len(self._base):])

    def turn_content(self, turn_ids: Sequence[int]) -> str:
        """A model turn's text as an assistant message content (its closing stop token left to the template)."""
        ids = [int(t) for t in turn_ids]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)

    def render_response(self, turns: Sequence[tuple[str, Any]]) -> Optional[list[int]]:
        """A fresh rendering of the conversation after the prompt, for the sanity check: turns are ("assistant",
        turn_ids) and ("tool", [texts], ...) in order, the last an assistant turn that ended with a stop token. Returns the
        token ids the chat template gives that part of the conversation (prompt placeholder removed)."""
        messages = []
        for role, *value in turns:
            if role == "assistant":
                messages.append({"role": "assistant", "content": self.turn_content(value[0])})
            else:
                messages += [{"role": "tool", "content": t} for t in value[0]]
        header = self._render(_PLACEHOLDER, generation_prompt=True)
        full = self._render(_PLACEHOLDER + messages)
        if not full.startswith(header):
            return None
        return self.encode(full[len(header):])
