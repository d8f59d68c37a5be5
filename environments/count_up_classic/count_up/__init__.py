"""count-up: a classic verifiers (0.1) multi-turn environment, written the way classic verifiers
environments were: `load_environment(**args)` returns a `vf.MultiTurnEnv` whose
`env_response` answers each model turn and whose `is_completed` ends the episode.

The user says a number; each turn the model answers with the next one, and the environment
says "next" until `num_turns` answers were given. Reward: the share of answers that are right
(the first answer is `start + 1`, each later one the previous right answer + 1).

rlbus runs it from a venv of its own (`rl env install environments/count_up_classic`: the
package requires classic verifiers), through `rlbus_orchestrator.envs.classic_remote`.
"""

import verifiers as vf
from datasets import Dataset


def expected(start: int, num_turns: int) -> list[str]:
    return [str(start + k) for k in range(1, num_turns + 1)]


class CountUpEnv(vf.MultiTurnEnv):
    def __init__(self, num_turns: int, **kwargs):
        super().__init__(max_turns=num_turns + 1, **kwargs)
        self.num_turns = num_turns

    async def is_completed(self, messages, state, **kwargs) -> bool:
        return sum(m["role"] == "assistant" for m in messages) >= self.num_turns

    async def env_response(self, messages, state, **kwargs):
        state["answers"] = state.get("answers", 0) + 1
        return [{"role": "user", "content": "next"}], state


def load_environment(num_turns: int = 3, num_examples: int = 32, **kwargs) -> vf.Environment:
    starts = [(7 * i) % 50 for i in range(num_examples)]
    rows = {
        "question": [str(s) for s in starts],
        "answer": [" ".join(expected(s, num_turns)) for s in starts],
    }

    def right_share(completion, answer, **kwargs) -> float:
        said = [m["content"].strip() for m in completion if m["role"] == "assistant"]
        wanted = answer.split()
        return sum(a == b for a, b in zip(said, wanted, strict=False)) / len(wanted)

    return CountUpEnv(
        num_turns,
        dataset=Dataset.from_dict(rows),
        system_prompt="Count up: answer each message with the next number.",
        rubric=vf.Rubric(funcs=[right_share], weights=[1.0]),
        **kwargs,
    )
