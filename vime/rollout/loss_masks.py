"""How an SFT conversation becomes tokens and a loss mask: slime's rules (its `MultiTurnLossMaskGenerator`),
one per `--loss-mask-type`, so a script written for slime trains the same tokens on vime.

* `qwen`: each message rendered by the chat template on its own (the tools with the first) and
  the renderings joined; what the template puts before every message (a default system prompt)
  is cut from all but the first. An assistant message is trained after its header: its text and
  the tokens that close its turn (`<|im_end|>` and the newline, in ChatML).
* `qwen3`: the same, with each message rendered after a made-up user turn (the first before one),
  so Qwen3's templates treat every assistant message as the last answer and keep its `<think>`
  part (the empty `<think>` block of a turn without one is trained too); consecutive tool messages
  are rendered together, as Qwen's templates wrap them in one user turn.
* `qwen3_5`: the whole conversation rendered once; each assistant turn is trained from after its
  `<|im_start|>assistant\\n` header (and after `<think>\\n` where the turn opens with it) through
  its `<|im_end|>` and newline, by the tokenizer's character offsets.
* `distill_qwen` (and `qwen` with a tokenizer that has DeepSeek-R1-distill's `<｜Assistant｜>`):
  the first message rendered as a prompt, then the last message's text as it is, all of it trained.

A message with `"step_loss_mask": 0` is never trained. The per-message rules measure the template
once (`_Template`): how many tokens it puts before every message, and how many its generation
prompt (the assistant header) has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime.rollout.data.rows import DataError

_PROBE = "FOR TESTING ONLY"  # a text found twice in a two-message rendering: where each message's text sits
_PREFIX = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}  # qwen3's made-up user turn
_DISTILL_ASSISTANT = "<｜Assistant｜>"  # DeepSeek-R1-distill's tokenizer: its `qwen` masks are distill_qwen's
_HEADER, _THINK, _END = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"


@dataclass(frozen=True)
class _Template:
    """What the per-message rules cut: the tokens a template puts before every message rendered on
    its own (`system`: a default system prompt), and the generation prompt's (`header`)."""

    system: int
    header: int


def _trained(message: dict[str, Any]) -> bool:
    return message.get("step_loss_mask", 1) == 1


class LossMasks:
    """A conversation → (token ids, loss mask) by one of slime's rules (see the module's docstring)."""

    def __init__(self, tokenizer: Any, loss_mask_type: str, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        if loss_mask_type == "qwen" and _DISTILL_ASSISTANT in tokenizer.get_added_vocab():
            loss_mask_type = "distill_qwen"
        self.rule: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], tuple[list[int], list[int]]] = {
            "qwen": self._qwen,
            "qwen3": self._qwen3,
            "qwen3_5": self._qwen3_5,
            "distill_qwen": self._distill_qwen,
        }[loss_mask_type]
        self.loss_mask_type = loss_mask_type
        self.template = self._measure() if loss_mask_type in ("qwen", "qwen3") else _Template(0, 0)

    def encode(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        ids, mask = self.rule(messages, tools)
        if len(ids) != len(mask):  # a rule's own fault, never the data's
            raise AssertionError(f"--loss-mask-type {self.loss_mask_type}: {len(ids)} tokens, {len(mask)} mask values")
        return ids, mask

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any
    ) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=True, tools=tools, return_dict=False, **self.template_kwargs, **kw
        )
        return list(out)

    def _text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, **self.template_kwargs, **kw)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _measure(self) -> _Template:
        """Two user messages rendered together: where the probe's two copies land gives the tokens
        each message's rendering has around its text, and so what comes before the first message
        only (the system prompt); the generation prompt is what add_generation_prompt adds."""
        probe, two = self._ids(_PROBE), [{"role": "user", "content": _PROBE}] * 2
        ids = self._ids(self._text(two))
        at = [i for i in range(len(ids) - len(probe) + 1) if ids[i : i + len(probe)] == probe]
        if len(at) != 2:
            raise DataError(
                f"--loss-mask-type {self.loss_mask_type}: the chat template does not render a message's text as it is "
                "(two user messages did not show their text twice), so the per-message rule cannot cut its turns: "
                "use --loss-mask-type qwen3_5, which renders the conversation whole"
            )
        after = len(ids) - len(probe) - at[1]  # tokens after the second message's text
        per_message = at[1] - at[0]
        system = at[0] - (per_message - after - len(probe))
        header = len(self._render(two, add_generation_prompt=True)) - len(ids)
        return _Template(system=system, header=header)

    def _turn_mask(self, message: dict[str, Any], n: int) -> list[int]:
        """An assistant turn's n tokens are trained after its header; any other message's are not."""
        if message.get("role") != "assistant" or not _trained(message):
            return [0] * n
        header = min(self.template.header, n)
        return [0] * header + [1] * (n - header)

    def _qwen(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            part = self._render([message], tools if i == 0 else None)
            if i > 0 and message.get("role") != "system":
                part = part[self.template.system :]
            ids += part
            mask += self._turn_mask(message, len(part))
        return ids, mask

    def _qwen3(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
        prefix = self._render([_PREFIX])
        ids: list[int] = []
        mask: list[int] = []
        i = 0
        while i < len(messages):
            end = i + 1
            if messages[i].get("role") == "tool":  # one user turn of tool responses
                while end < len(messages) and messages[end].get("role") == "tool":
                    end += 1
            group = messages[i:end]
            if i == 0:
                part = self._render([*group, _PREFIX], tools)[: -len(prefix)]
            else:
                part = self._render([_PREFIX, *group])[len(prefix) :]
                if messages[i].get("role") != "system":
                    part = part[self.template.system :]
            ids += part
            mask += self._turn_mask(messages[i], len(part))
            i = end
        return ids, mask

    def _qwen3_5(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], list[int]]:
        text = self._text(messages, tools)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        chars = [0] * (len(text) + 1)  # chars[k]: trained characters before k
        trained = [0] * len(text)
        cursor = 0
        for n, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            header = text.find(_HEADER, cursor)
            end = text.find(_END, header + len(_HEADER)) if header >= 0 else -1
            if end < 0:
                raise DataError(
                    f"--loss-mask-type qwen3_5: message {n} (assistant) is not rendered as "
                    f"{_HEADER!r}...{_END!r} by this chat template: use --loss-mask-type qwen or qwen3"
                )
            start = header + len(_HEADER)
            stop = end + len(_END) + (text[end + len(_END) : end + len(_END) + 1] == "\n")
            cursor = stop
            if _trained(message):
                start += len(_THINK) if text.startswith(_THINK, start) else 0
                trained[start:stop] = [1] * (stop - start)
        for k, t in enumerate(trained):
            chars[k + 1] = chars[k] + t
        mask = [int(b > a and chars[b] > chars[a]) for a, b in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _distill_qwen(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], list[int]]:
        prompt = self._ids(self._text(messages[:1], tools, add_generation_prompt=True))
        response = self._ids(messages[-1]["content"])
        trained = 1 if _trained(messages[-1]) else 0
        return prompt + response, [0] * len(prompt) + [trained] * len(response)
