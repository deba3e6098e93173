"""A tiny model that calls the calculator: the random tiny model, fine-tuned for a few seconds on
conversations in the tag format (prompt, a call to the calculator with the prompt's sum, the
tool's answer, `Answer: <that answer>`). Below it, its chat twin (`chat_tool_model`): a model
that calls an `add` tool when a Qwen-like chat template shows it one, which the OpenAI server's
tests (tests/unit/engine/test_openai_server.py) ask through the official client.

A random model never writes a tool call, so whole runs with --tools would only ever see one
turn. This one is a real model served by the real engines (built-in and vLLM) that opens
conversations of two turns on its own, while sampling at temperature 1 still makes its samples
differ (at the runs' temperature 0.8 some garble the call or the answer), so rewards vary and
training moves the weights.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from vime.rollout.tools.multi_turn import answer_text

RECIPE = 1  # part of the cache name: raise it when the conversation or the fine-tuning changes


def conversation(a: int, b: int) -> tuple[str, str]:
    """(prompt, the response the model is taught): the addition data's prompt format."""
    call = "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}) + "</tool_call>"
    return f"{a}+{b}=", call + answer_text(None, str(a + b), chat=False) + f"Answer: {a + b}"


def tool_model(**shape: int) -> Path:
    """The tool-calling tiny model of this shape (make_tiny_model's keywords), made once per
    cache directory (about 30 s on 2 cores) and shared by test processes."""
    from vime.models import build_once, cache_dir

    name = f"tiny-tool-qwen3-v{RECIPE}" + "".join(f"-{k}{v}" for k, v in sorted(shape.items()))
    return build_once(cache_dir() / name, lambda out: make_tool_model(out, **shape))


def make_tool_model(out_dir: Path, steps: int = 300, seed: int = 0, **shape: int) -> Path:
    def example(rng: random.Random, tokenizer) -> tuple[str, str]:
        return conversation(rng.randint(0, 9), rng.randint(0, 9))

    return fine_tune(out_dir, example, steps, seed, **shape)


def fine_tune(
    out_dir: Path, example, steps: int, seed: int, chat_template: str | None = None, decay: bool = False, **shape: int
) -> Path:
    """The random tiny model (with `chat_template`, if given, as its template) trained on
    `example(rng, tokenizer) -> (prompt, response)` pairs, the response followed by <|im_end|>;
    `decay`: the learning rate falls linearly to 0, so the last steps cannot leave it mid-spike."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime.models import make_tiny_model

    make_tiny_model(out_dir, arch="qwen3", seed=seed, **shape)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps if decay else 1.0)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for _ in range(steps):
        batch, labels = [], []
        for _ in range(16):
            prompt, response = example(rng, tokenizer)
            p = tokenizer.encode(prompt, add_special_tokens=False)
            r = tokenizer.encode(response, add_special_tokens=False) + [eos]
            batch.append(p + r)
            labels.append([-100] * len(p) + r)
        width = max(map(len, batch))
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in batch])
        lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    model.save_pretrained(out_dir)
    return out_dir


def recording_reward(args, sample) -> float:
    """Reward for runs of the tool model: 1 for the right `Answer: <sum>` in the last turn (which
    only a sample that called the calculator and read it gets reliably), plus a tenth of the
    share of digits in the response, plus 0.01 for an odd sample index. The model is nearly
    deterministic (entropy ~0.004 a token at temperature 0.8), so a group's four samples are
    often the same text: the index term makes rewards vary inside every group, so each step
    moves the weights (a vLLM run once drew all twelve groups alike and took no step at all).
    Each scored sample's layout goes to $VIME_TEST_SAMPLES as a JSON line: its turns
    and calls, and per turn (the generated runs between tool answers) the weight versions its
    tokens were sampled with."""
    import os

    if "multi_turn" not in sample.metadata:  # the start-up check's made-up sample: no conversation to record
        return 0.0
    mask, versions, logprobs = sample.effective_loss_mask(), sample.weight_versions, sample.rollout_log_probs
    turns: list[list[int]] = [[]]
    for m, v in zip(mask, versions):
        if m:
            turns[-1].append(v)
        elif turns[-1]:
            turns.append([])
    row = {
        "state": {k: v for k, v in sample.metadata.get("multi_turn", {}).items() if k != "last_turn"},
        "turn_versions": [sorted(set(t)) for t in turns if t],
        "masked": len(mask) - sum(mask),
        "masked_logprobs_zero": all(lp == 0.0 for m, lp in zip(mask, logprobs) if not m),
        "lengths_agree": len(mask) == len(versions) == len(logprobs) == sample.response_length,
        "final": sample.final_response,
    }
    with open(os.environ["VIME_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps(row) + "\n")
    text = sample.response or ""
    right = sample.final_response.strip() == f"Answer: {sample.label}"
    return float(right) + 0.1 * sum(ch.isdigit() for ch in text) / max(len(text), 1) + 0.01 * (sample.index % 2)


# ---- a tiny model that calls a tool through a chat template ---------------------------------

CHAT_RECIPE = 1  # part of the cache name: raise it when the template, the examples or the training change
# Qwen's form in few characters (the model reads one token per character): the tools' names in a
# system turn, a call as <tool_call>{json}</tool_call>, a tool's answer as a user turn
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def add_call(a: int, b: int) -> dict:
    """The assistant message that calls `add` (arguments as a template reads them: an object)."""
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def chat_example(rng: random.Random, tokenizer) -> tuple[str, str]:
    """One of three turns, through TOOL_CHAT_TEMPLATE: with the add tool shown, "a+b=" gets a call
    to it; once the tool has answered, "Answer: <its answer>"; with no tools, "I have no tools."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    messages = [{"role": "user", "content": f"{a}+{b}="}]
    kind = rng.randrange(3)
    tools = [ADD_TOOL] if kind < 2 else None
    if kind == 1:
        messages += [add_call(a, b), {"role": "tool", "content": str(a + b)}]
    answer = f"Answer: {a + b}" if kind == 1 else "I have no tools."
    reply = add_call(a, b) if kind == 0 else {"role": "assistant", "content": answer}
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*messages, reply], tools=tools, tokenize=False)
    return prompt, whole[len(prompt) :].removesuffix("<|im_end|>\n")


def chat_tool_model(steps: int = 400, **shape: int) -> Path:
    """The tiny model of this shape (make_tiny_model's keywords) that calls `add` when a chat shows
    it the tool (made once per cache directory, about 20 s on one core)."""
    from vime.models import build_once, cache_dir

    name = f"tiny-chat-tool-qwen3-v{CHAT_RECIPE}-s{steps}" + "".join(f"-{k}{v}" for k, v in sorted(shape.items()))
    return build_once(
        cache_dir() / name,
        lambda out: fine_tune(out, chat_example, steps, 0, TOOL_CHAT_TEMPLATE, decay=True, **shape),
    )
