"""The `wiki-search` environment: questions about the encyclopedia's animals, looked up with tools.

An episode (a MultiTurnEnv with the tools `search` and `open`, corpus.py):

    system: "Tools: search, open."
    user:   "What color is Zorbix?"
    assistant: <tool_call>{"name":"search","arguments":{"query":"Zorbix"}}</tool_call>
    tool:      #42 Zorbix
               #17 Zorbin
    assistant: <tool_call>{"name":"open","arguments":{"id":"#42"}}</tool_call>
    tool:      Zorbix is a blue fox from Kell. It eats figs.
    assistant: blue                                  <- no tool call: the episode ends

The model writes its calls in the hermes format; vLLM's `hermes` parser (the qwen3 family's)
turns them into tool calls, `MultiTurnEnv` runs them and sends the results back as `tool`
messages; a failed call (unknown tool, broken JSON, an id that is no page) is answered with an
`error: ...` tool message and the episode goes on. An answer without a tool call ends it.

Reward: 1.0 when the final answer is the asked fact (case, surrounding spaces and a final period
ignored), else 0.0. No format reward: a well-formed episode that answers wrong earns nothing.
Two components are reported with it (metrics `reward/<name>/mean`): `exact_answer` (the reward)
and `opened_page` (the episode opened the page the answer is on; not rewarded, a diagnostic).

Questions are (page, fact) pairs, three a page (`ATTRIBUTES`): a seeded shuffle puts `num_eval`
of them in the eval split (taken in order) and the rest in the train split, from which example
`i` is drawn with `random.Random((seed, "train", i))`.
"""

import random
from typing import Any

from rlbus.wire.tasks import ChatMessage, Problem
from rlbus_orchestrator.envs.base import Score, Split
from rlbus_orchestrator.envs.multiturn import MultiTurnEnv
from rlbus_orchestrator.envs.tools import tool
from wiki_search.corpus import ATTRIBUTES, PAGES_PATH, Corpus, Page

SYSTEM_PROMPT = "Tools: search, open."
QUESTIONS = {
    "color": "What color is {title}?",
    "home": "Where is {title} from?",
    "food": "What does {title} eat?",
}
"""The question of each fact (`ATTRIBUTES`)."""


def question_text(page: Page, attribute: str) -> str:
    return QUESTIONS[attribute].format(title=page.title)


def normalize(answer: str) -> str:
    """An answer as it is compared: lower case, no surrounding spaces, no final period."""
    return answer.strip().rstrip(".").strip().lower()


def final_answer(conversation: list[dict[str, Any]]) -> str:
    """The text of the episode's last assistant turn when it called no tool (else "": the
    episode ended on a tool call, a limit or a broken call, without an answer)."""
    if not conversation:
        return ""
    last = conversation[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return ""
    return str(last.get("content") or "")


class WikiSearchEnv(MultiTurnEnv):
    """Questions about the corpus's pages, answered with `search` and `open` (module docstring)."""

    env_id = "wiki-search"
    max_turns = 4
    """search, open, answer, and one turn to spare (a retried search or a second page)."""

    def __init__(
        self,
        *,
        seed: int = 0,
        pages: str | None = None,
        num_results: int = 2,
        num_eval: int = 60,
        max_turns: int = 4,
        system_prompt: str = SYSTEM_PROMPT,
    ) -> None:
        self.corpus = Corpus.load(pages or PAGES_PATH, num_results)
        self.tools = [
            tool(name="search", timeout_s=5)(self.corpus.search),
            tool(name="open", timeout_s=5)(self.corpus.open),
        ]
        questions = [
            (pid, attribute) for pid in sorted(self.corpus.pages) for attribute in ATTRIBUTES
        ]
        if not 0 < num_eval < len(questions):
            raise ValueError(
                f"wiki-search: num_eval must be between 1 and {len(questions) - 1} (the corpus has "
                f"{len(questions)} questions), got {num_eval}"
            )
        random.Random(f"wiki-search-split/{seed}").shuffle(questions)
        self.eval_questions, self.train_questions = questions[:num_eval], questions[num_eval:]
        self.seed, self.max_turns, self.system_prompt = seed, max_turns, system_prompt

    def num_examples(self, split: Split) -> int | None:
        return len(self.eval_questions) if split == "eval" else None

    def question(self, split: Split, index: int) -> tuple[str, str]:
        """(page id, attribute) of example `index` of `split`."""
        if split == "eval":
            return self.eval_questions[index % len(self.eval_questions)]
        return random.Random(f"wiki-search/{self.seed}/train/{index}").choice(self.train_questions)

    def example(self, split: Split, index: int) -> Problem:
        pid, attribute = self.question(split, index)
        page = self.corpus.pages[pid]
        return Problem(
            messages=[
                ChatMessage(role="system", content=self.system_prompt),
                ChatMessage(role="user", content=question_text(page, attribute)),
            ],
            answer=page.fact(attribute),
            info={"page_id": pid, "attribute": attribute},
        )

    async def score(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Score:
        answer = final_answer(conversation)
        exact = float(normalize(answer) == normalize(problem.answer or ""))
        page_text = self.corpus.pages[problem.info["page_id"]].text
        opened = float(
            any(
                m["role"] == "tool" and m.get("name") == "open" and m.get("content") == page_text
                for m in conversation
            )
        )
        return Score(
            reward=exact,
            components={"exact_answer": exact, "opened_page": opened},
            completion_text=answer,
        )
