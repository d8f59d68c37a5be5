"""wiki-search (environments/wiki_search): its corpus and tools, its questions and reward, whole
episodes with tool calls against the scripted engine of the multi-turn tests (good and bad
calls), and its SFT demonstrations."""

import asyncio
import json
import random
import re

import pytest
from env_packages import ensure_env_package

from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.envs.registry import load_environment

ensure_env_package("wiki_search", "wiki_search")

from unit.orchestrator.multiturn_fakes import IM_END, FakeEngine, Scripted, text_ids  # noqa: E402
from wiki_search import WikiSearchEnv  # noqa: E402
from wiki_search.corpus import (  # noqa: E402
    ATTRIBUTES,
    NO_RESULTS,
    PAGES_PATH,
    Corpus,
    generate_pages,
    write_pages,
)
from wiki_search.demos import Noise, demonstration, main, tool_call_text  # noqa: E402
from wiki_search.env import SYSTEM_PROMPT, question_text  # noqa: E402

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""What vLLM's hermes parser reads a call from (its JSON is then json.loads'ed)."""


def make_env(**args) -> WikiSearchEnv:
    return WikiSearchEnv(**args)


def play(env, engine, problem):
    return asyncio.run(env.run_episode(engine, problem, SamplingArgs()))


def search_call(query: str) -> tuple[str, str]:
    return ("search", json.dumps({"query": query}))


def open_call(pid: str) -> tuple[str, str]:
    return ("open", json.dumps({"id": pid}))


# ---- corpus and tools -----------------------------------------------------------------------


def test_the_shipped_corpus_is_what_the_generator_writes_for_seed_0(tmp_path):
    write_pages(generate_pages(0), tmp_path / "pages.jsonl")
    assert (tmp_path / "pages.jsonl").read_text() == PAGES_PATH.read_text()


def test_pages_are_deterministic_per_seed_with_distinct_titles_and_short_texts():
    pages = generate_pages(0)
    assert pages == generate_pages(0) and pages != generate_pages(1)
    assert len(pages) == 100 and len({p.title for p in pages}) == 100
    assert [p.id for p in pages] == [f"#{i:02d}" for i in range(100)]
    assert max(len(p.text) for p in pages) <= 60


def test_search_ranks_the_page_of_a_name_first_and_lists_ids_and_titles():
    corpus = Corpus.load()
    for page in corpus.pages.values():
        first, *rest = corpus.search(page.title).splitlines()
        assert first == f"{page.id} {page.title}"
        assert len(rest) == 1 and re.fullmatch(r"#\d\d [A-Z][a-z]+", rest[0])
    assert corpus.search(f"What color is {corpus.pages['#07'].title}?").startswith("#07 ")


def test_search_finds_a_misspelled_name_and_says_when_nothing_matches():
    corpus = Corpus.load()
    title = corpus.pages["#11"].title
    assert corpus.search(title[:-1] + "q").splitlines()[0] == f"#11 {title}"
    assert corpus.search("") == corpus.search("?!") == NO_RESULTS


def test_open_returns_a_page_text_and_refuses_an_unknown_id():
    corpus = Corpus.load()
    page = corpus.pages["#03"]
    assert corpus.open("#03") == corpus.open(" #03 ") == page.text
    assert page.title in page.text and all(page.fact(a) in page.text for a in ATTRIBUTES)
    with pytest.raises(ValueError, match="no page '#999'; page ids come from search"):
        corpus.open("#999")


def test_the_tools_are_named_search_and_open_with_their_arguments():
    schemas = {t.name: t.schema()["function"] for t in make_env().tools}
    assert schemas["search"]["parameters"]["required"] == ["query"]
    assert schemas["open"]["parameters"]["required"] == ["id"]
    assert schemas["search"]["description"].startswith("Search the pages")


# ---- questions and reward -------------------------------------------------------------------


def test_questions_are_deterministic_per_seed_split_and_index():
    a, b = make_env(), make_env()
    for split in ("train", "eval"):
        for i in (0, 1, 57, 1000):
            assert a.example(split, i) == b.example(split, i)
    assert [make_env(seed=1).example("train", i) for i in range(20)] != [
        a.example("train", i) for i in range(20)
    ]


def test_train_and_eval_ask_different_questions_and_eval_is_a_fixed_list():
    env = make_env(num_eval=60)
    assert env.num_examples("eval") == 60 and env.num_examples("train") is None
    eval_questions = {env.question("eval", i) for i in range(60)}
    train_questions = {env.question("train", i) for i in range(2000)}
    assert len(eval_questions) == 60 and not eval_questions & train_questions
    assert env.example("eval", 60) == env.example("eval", 0)


def test_a_problem_asks_about_one_fact_of_one_page():
    env = make_env()
    problem = env.example("train", 3)
    page = env.corpus.pages[problem.info["page_id"]]
    attribute = problem.info["attribute"]
    assert [m.role for m in problem.messages] == ["system", "user"]
    assert problem.messages[0].content == SYSTEM_PROMPT
    assert problem.messages[1].content == question_text(page, attribute)
    assert problem.answer == page.fact(attribute)


@pytest.mark.parametrize(
    ("conversation", "reward"),
    [
        ([{"role": "assistant", "content": "{answer}"}], 1.0),
        ([{"role": "assistant", "content": " {ANSWER}. "}], 1.0),
        ([{"role": "assistant", "content": "the {answer}"}], 0.0),
        ([{"role": "assistant", "content": ""}], 0.0),
        ([], 0.0),
        # ended on a tool call (a limit): no answer, whatever the tool said
        (
            [
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
                {"role": "tool", "name": "open", "content": "{answer}"},
            ],
            0.0,
        ),
    ],
)
def test_the_reward_is_the_exact_answer_of_the_last_turn(conversation, reward):
    env = make_env()
    problem = env.example("train", 0)
    filled = [
        {**m, "content": m["content"].format(answer=problem.answer, ANSWER=problem.answer.upper())}
        for m in conversation
    ]
    score = asyncio.run(env.score(problem, filled, {}))
    assert score.reward == score.components["exact_answer"] == reward


def test_opened_page_says_whether_the_answer_s_page_was_read():
    env = make_env()
    problem = env.example("train", 0)
    page = env.corpus.pages[problem.info["page_id"]]
    other = next(p for p in env.corpus.pages.values() if p.id != page.id)
    for text, opened in ((page.text, 1.0), (other.text, 0.0)):
        conversation = [{"role": "tool", "name": "open", "content": text}]
        score = asyncio.run(env.score(problem, conversation, {}))
        assert score.components["opened_page"] == opened


# ---- whole episodes -------------------------------------------------------------------------


def test_an_episode_searches_opens_and_answers_and_only_the_model_s_tokens_are_trained():
    env = make_env()
    problem = env.example("train", 5)
    pid = problem.info["page_id"]
    page = env.corpus.pages[pid]
    engine = FakeEngine(
        [
            Scripted("", tool_calls=[search_call(page.title)]),
            Scripted("", tool_calls=[open_call(pid)]),
            Scripted(problem.answer),
        ]
    )
    sample = play(env, engine, problem)
    assert (sample.reward, sample.reward_components) == (
        1.0,
        {"exact_answer": 1.0, "opened_page": 1.0},
    )
    assert (sample.num_turns, sample.num_tool_calls, sample.num_tool_errors) == (3, 2, 0)
    assert sample.stop_reason == "done" and sample.completion_text == problem.answer
    tools = [m for m in sample.messages if m.role == "tool"]
    assert [m.name for m in tools] == ["search", "open"]
    assert tools[0].content.splitlines()[0] == f"{pid} {page.title}"
    assert tools[1].content == page.text
    assert engine.requests[0]["turn"].tools == [t.schema() for t in env.tools]
    # the tool results are in the trained sequence with loss mask 0, the answer with mask 1
    ids, mask = sample.completion_token_ids, sample.completion_mask
    start = find(ids, text_ids(page.text))
    assert set(mask[start : start + len(page.text)]) == {0}
    answer = text_ids(problem.answer) + [IM_END]
    assert ids[-len(answer) :] == answer and mask[-len(answer) :] == [1] * len(answer)


def find(ids: list[int], part: list[int]) -> int:
    for i in range(len(ids) - len(part) + 1):
        if ids[i : i + len(part)] == part:
            return i
    raise AssertionError("not in the sequence")


def test_bad_tool_calls_are_answered_with_errors_and_the_episode_goes_on():
    env = make_env()
    problem = env.example("train", 8)
    pid = problem.info["page_id"]
    engine = FakeEngine(
        [
            Scripted("", tool_calls=[("lookup", '{"query": "x"}'), ("search", '{"query": ')]),
            Scripted("", tool_calls=[open_call("#999")]),
            Scripted('<tool_call>{"name": "open", "arguments": {"id": '),
            Scripted("", tool_calls=[open_call(pid)]),
        ]
    )
    sample = play(env, engine, problem)
    errors = [m.content for m in sample.messages if m.role == "tool"]
    assert errors[0] == "error: unknown tool 'lookup'; the tools are: open, search"
    assert errors[1].startswith("error: the arguments of 'search' are not a JSON object")
    assert errors[2].startswith("error: tool 'open' raised ValueError: no page '#999'")
    assert errors[3].startswith("error: the tool call could not be parsed")
    assert errors[4] == env.corpus.pages[pid].text
    # four turns (the class's max_turns) without an answer: scored 0, the page was read
    assert (sample.num_turns, sample.stop_reason) == (4, "max_turns")
    assert (sample.num_tool_calls, sample.num_tool_errors) == (5, 4)
    assert sample.reward == 0.0 and sample.reward_components["opened_page"] == 1.0


def test_an_answer_after_a_failed_call_still_counts():
    env = make_env(max_turns=3)
    problem = env.example("eval", 2)
    engine = FakeEngine([Scripted("", tool_calls=[open_call("#999")]), Scripted(problem.answer)])
    sample = play(env, engine, problem)
    assert (sample.reward, sample.num_tool_errors, sample.stop_reason) == (1.0, 1, "done")


def test_the_registry_builds_it_from_the_installed_entry_point():
    env = load_environment("wiki-search", {"seed": 3, "num_eval": 30})
    assert isinstance(env, WikiSearchEnv)
    assert env.env_id == "wiki-search" and env.num_examples("eval") == 30


def test_bad_arguments_are_refused_with_the_range():
    with pytest.raises(ValueError, match="num_eval must be between 1 and 299"):
        make_env(num_eval=300)
    with pytest.raises(ValueError, match="num_results must be >= 1"):
        make_env(num_results=0)


# ---- demonstrations -------------------------------------------------------------------------


def demo_corpus() -> Corpus:
    return Corpus(generate_pages("test-demos"))


def test_a_clean_demonstration_is_the_episode_the_environment_wants():
    corpus = demo_corpus()
    messages = demonstration(corpus, random.Random(0), Noise(0, 0, 0, 0))
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    calls = [json.loads(HERMES_CALL.fullmatch(m["content"]).group(1)) for m in messages[2:6:2]]
    title = re.search(r"(?:is|does) ([A-Z][a-z]+)", messages[1]["content"]).group(1)
    page = corpus.by_title[title.lower()]
    assert calls == [
        {"name": "search", "arguments": {"query": title}},
        {"name": "open", "arguments": {"id": page.id}},
    ]
    assert messages[3]["content"] == corpus.search(title)
    assert messages[5]["content"] == page.text
    assert messages[6]["content"] in {page.fact(a) for a in ATTRIBUTES}
    assert messages[1]["content"] in {question_text(page, a) for a in ATTRIBUTES}


def test_demonstrations_make_each_mistake_about_as_often_as_asked():
    corpus = demo_corpus()
    noise = Noise(guess=0.1, typo=0.1, second_hit=0.2, wrong_fact=0.15)
    episodes = [demonstration(corpus, random.Random(i), noise) for i in range(2000)]
    guesses = [e for e in episodes if len(e) == 3]
    looked_up = [e for e in episodes if len(e) == 7]
    assert len(guesses) + len(looked_up) == 2000
    assert 0.07 < len(guesses) / 2000 < 0.13
    second = sum(
        json.loads(HERMES_CALL.fullmatch(e[4]["content"]).group(1))["arguments"]["id"]
        != e[3]["content"].split()[0]
        for e in looked_up
    )
    assert 0.16 < second / len(looked_up) < 0.24


def test_the_demos_command_writes_the_same_file_every_time(tmp_path, capsys):
    for name in ("a.jsonl", "b.jsonl"):
        main([str(tmp_path / name), "--num", "120", "--seed", "4"])
    a = (tmp_path / "a.jsonl").read_text()
    assert a == (tmp_path / "b.jsonl").read_text()
    lines = [json.loads(line)["messages"] for line in a.splitlines()]
    assert len(lines) == 120 and all(m[0]["content"] == SYSTEM_PROMPT for m in lines)
    shipped = {p.title for p in Corpus.load().pages.values()}
    asked = {re.search(r"(?:is|does) ([A-Z][a-z]+)", m[1]["content"]).group(1) for m in lines}
    assert len(asked - shipped) > 0.8 * len(asked)  # practice pages, not the shipped ones


def test_tool_call_text_is_one_hermes_call():
    text = tool_call_text("open", {"id": "#01"})
    assert json.loads(HERMES_CALL.fullmatch(text).group(1)) == {
        "name": "open",
        "arguments": {"id": "#01"},
    }
