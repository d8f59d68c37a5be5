"""Play wiki-search episodes with a model directory on CPU (transformers, no vLLM, no run) and
print the mean reward, found-page rate and tool calls per episode, sampled and greedy.

    uv run python examples/wiki-search/evaluate.py examples/wiki-search/model [--num 128]

The episodes are played as the environment plays them (the same prompts, tools and score), with
the model's tool calls read the way vLLM's `hermes` parser reads them (the JSON between
`<tool_call>` and `</tool_call>`). Every turn of all running episodes is one batched `generate`.
"""

import argparse
import asyncio
import json
import re
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from wiki_search import WikiSearchEnv

from rlbus.wire.tasks import ToolCall, ToolFunction
from rlbus_orchestrator.envs.tools import call_tool, tool_message

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parsed_calls(text: str) -> list[ToolCall] | None:
    """The tool calls in `text` as the hermes parser finds them; None when they do not parse."""
    try:
        raw = [json.loads(a or b) for a, b in TOOL_CALL.findall(text)]
        return [
            ToolCall(
                id=f"call-{i}",
                function=ToolFunction(name=c["name"], arguments=json.dumps(c["arguments"])),
            )
            for i, c in enumerate(raw)
        ]
    except (ValueError, KeyError, TypeError):
        return None


def generate(model, tok, prompts: list[str], temperature: float, max_tokens: int) -> list[str]:
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=None,
            max_new_tokens=max_tokens,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.pad_token_id,
        )
    new = out[:, batch["input_ids"].shape[1] :]
    return [tok.decode(row, skip_special_tokens=True) for row in new]


async def play(model, tok, env, problems, temperature: float, max_tokens: int) -> list[dict]:
    rendered = [[{"role": m.role, "content": m.content} for m in p.messages] for p in problems]
    conversations: list[list[dict]] = [[] for _ in problems]
    calls = [0] * len(problems)
    active = list(range(len(problems)))
    for _ in range(env.max_turns):
        if not active:
            break
        prompts = [
            tok.apply_chat_template(rendered[i], tokenize=False, add_generation_prompt=True)
            for i in active
        ]
        texts = generate(model, tok, prompts, temperature, max_tokens)
        still = []
        for i, text in zip(active, texts, strict=True):
            rendered[i].append({"role": "assistant", "content": text})
            if "<tool_call>" not in text:
                conversations[i].append({"role": "assistant", "content": text})
                continue
            found = parsed_calls(text)
            message = {"role": "assistant", "content": text.split("<tool_call>")[0]}
            if found:
                message["tool_calls"] = [
                    {"id": c.id, "function": {"name": c.function.name}} for c in found
                ]
            conversations[i].append(message)
            tools = {t.name: t for t in env.tools}
            results = (
                [(await call_tool(tools, c)).message for c in found]
                if found
                else [tool_message("x", "", "error: the tool call could not be parsed")]
            )
            calls[i] += len(results)
            conversations[i] += results
            rendered[i] += [{"role": "tool", "content": r["content"]} for r in results]
            still.append(i)
        active = still
    scores = [await env.score(p, c, {}) for p, c in zip(problems, conversations, strict=True)]
    return [
        {"reward": s.reward, "opened": s.components["opened_page"], "calls": n, "messages": m}
        for s, n, m in zip(scores, calls, rendered, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--num", type=int, default=128, help="episodes per setting")
    parser.add_argument("--split", default="eval", choices=["train", "eval"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many greedy episodes")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    env = WikiSearchEnv()
    problems = [env.example(args.split, i) for i in range(args.num)]
    for name, temperature in (("sampled (T = 1)", 1.0), ("greedy", 0.0)):
        rows = asyncio.run(play(model, tok, env, problems, temperature, args.max_tokens))
        print(
            f"{name:>16}: reward {statistics.fmean(r['reward'] for r in rows):.3f}  "
            f"opened the page {statistics.fmean(r['opened'] for r in rows):.3f}  "
            f"tool calls/episode {statistics.fmean(r['calls'] for r in rows):.2f}",
            flush=True,
        )
    for row in rows[: args.show]:
        print(f"--- reward {row['reward']}")
        for m in row["messages"][1:]:
            print(f"{m['role']:>9}: {m['content']!r}")


if __name__ == "__main__":
    main()
