"""Play wordle games with a model directory in this process (transformers on CPU, no vLLM) and
print the mean reward and its parts (solved, guesses per game, greens, valid guesses).

    ./uvw run python examples/wordle/evaluate.py examples/wordle/model --temperature 1.0
    ./uvw run python examples/wordle/evaluate.py examples/wordle/model --temperature 0

The games are the environment's (rlbus_wordle: prompt, feedback, reward), each turn sampled from
exactly the tokens of the game so far, as the rollout workers do: the model's completion, then
the feedback turn in the tiny model's ChatML. Games of one call run as a batch, left-padded.
"""

import argparse
import statistics

import torch
from rlbus_wordle.env import WordleEnv, game_score, parse_guess, reply_to
from transformers import AutoModelForCausalLM, AutoTokenizer

IM_END = "<|im_end|>"


def feedback_turn(text: str) -> str:
    """What ChatML writes after an assistant turn's end token: the user's turn and the next
    assistant header (the tiny model's chat template)."""
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def sample(model, tokenizer, rows, *, temperature, max_tokens):
    """One completion per row of token ids (its end token kept when it stopped)."""
    end_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.pad_token_id
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None,
        top_p=1.0 if temperature > 0 else None,
        eos_token_id=end_id,
        pad_token_id=pad_id,
    )
    completions = []
    for row in out[:, width:].tolist():
        if end_id in row:
            row = row[: row.index(end_id) + 1]
        completions.append(row)
    return completions


def play(model, tokenizer, env, secrets, *, temperature, max_tokens):
    """The guesses of one game per secret."""
    end_id = tokenizer.convert_tokens_to_ids(IM_END)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": env.prompt}], add_generation_prompt=True, tokenize=False
    )
    seqs = [tokenizer.encode(prompt, add_special_tokens=False) for _ in secrets]
    guesses = [[] for _ in secrets]
    active = list(range(len(secrets)))
    for _ in range(env.max_turns):
        outs = sample(
            model,
            tokenizer,
            [seqs[i] for i in active],
            temperature=temperature,
            max_tokens=max_tokens,
        )
        still = []
        for i, out in zip(active, outs, strict=True):
            stopped = bool(out) and out[-1] == end_id
            guess = parse_guess(tokenizer.decode(out[:-1] if stopped else out))
            guesses[i].append(guess)
            if stopped and guess != secrets[i]:
                reply = reply_to(guesses[i], secrets[i], env.words)
                seqs[i] += out + tokenizer.encode(feedback_turn(reply), add_special_tokens=False)
                still.append(i)
        active = still
        if not active:
            break
    return guesses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF model directory")
    parser.add_argument("--split", choices=["train", "eval"], default="train")
    parser.add_argument("--games", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    env = WordleEnv()
    secrets = [env.secret(args.split, i) for i in range(args.games)]
    scores = []
    with torch.no_grad():
        for start in range(0, len(secrets), args.batch):
            batch = secrets[start : start + args.batch]
            for guesses, secret in zip(
                play(
                    model,
                    tokenizer,
                    env,
                    batch,
                    temperature=args.temperature,
                    max_tokens=args.max_tokens,
                ),
                batch,
                strict=True,
            ):
                scores.append(game_score(guesses, secret, env.words, env.max_turns))
    mean = {k: statistics.fmean(s.components[k] for s in scores) for k in scores[0].components}
    print(
        f"{args.model} split={args.split} T={args.temperature:g} games={len(scores)}: "
        f"reward {statistics.fmean(s.reward for s in scores):.3f} | solved {mean['solved']:.3f} | "
        f"guesses {mean['guesses']:.2f} | greens {mean['greens']:.3f} | valid {mean['valid']:.3f}"
    )
    for s in scores[:4]:
        print("  ", s.completion_text)


if __name__ == "__main__":
    main()
