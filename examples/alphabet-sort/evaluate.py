"""Mean alphabet-sort reward of a model on eval episodes, played with transformers on CPU.

    ./uvw run python examples/alphabet-sort/evaluate.py examples/alphabet-sort/model \
        [--num 128] [--temperature 1.0 0.7 0]

Each turn of every episode is generated in one batch (left padding), the environment answers
(`respond`) and scores (`score`) as it does in an RL run; temperature 0 is greedy. The numbers
of examples/alphabet-sort/README.md come from this script.
"""

import argparse
import asyncio
import json

import torch
from alphabet_sort import AlphabetSortEnv
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus_orchestrator.envs.base import problem_messages


def generate(model, tokenizer, conversations, temperature, max_tokens):
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in conversations
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0}
        if temperature
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
        )
    return [
        tokenizer.decode(row[batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for row in out
    ]


def mean_reward(model, tokenizer, env, num, temperature, max_tokens):
    problems = [env.example("eval", i) for i in range(num)]
    conversations = [problem_messages(p) for p in problems]
    answered = [[] for _ in problems]
    for _ in range(env.num_turns):
        answers = generate(model, tokenizer, conversations, temperature, max_tokens)
        for problem, conversation, own, answer in zip(
            problems, conversations, answered, answers, strict=True
        ):
            own.append({"role": "assistant", "content": answer.strip()})
            conversation.append(own[-1])
            reply = asyncio.run(env.respond(problem, own, {}))
            own += reply.messages
            conversation += reply.messages
    scores = [asyncio.run(env.score(p, own, {})) for p, own in zip(problems, answered, strict=True)]
    means = {key: sum(s.components[key] for s in scores) / num for key in scores[0].components}
    return {"reward": sum(s.reward for s in scores) / num, **means}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--num", type=int, default=128)
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7, 0.0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env-args", type=json.loads, default={}, help="environment args (JSON)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    env = AlphabetSortEnv(**args.env_args)
    for temperature in args.temperature:
        result = mean_reward(model, tokenizer, env, args.num, temperature, args.max_tokens)
        print(f"T={temperature:g}: " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
