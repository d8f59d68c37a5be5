"""alphabet-sort (environments/alphabet_sort): its generated data, its reward, whole episodes
against the scripted engine of the multi-turn tests, and its SFT demonstrations."""

import asyncio
import json

import pytest
from env_packages import ensure_env_package

from rlbus.wire.tasks import EpisodeLimits, SamplingArgs
from rlbus_orchestrator.envs.registry import load_environment

ensure_env_package("alphabet_sort", "alphabet_sort")

from alphabet_sort import AlphabetSortEnv  # noqa: E402
from alphabet_sort.demos import demonstration, lazy_answer, main  # noqa: E402
from alphabet_sort.env import SYSTEM_PROMPT, episode_score, expected_answers  # noqa: E402
from unit.orchestrator.multiturn_fakes import IM_END, FakeEngine, Scripted, render  # noqa: E402

TURNS = [["kel", "bam"], ["dor", "zif"], ["pux", "hon"]]
RIGHT = ["bam kel", "bam dor kel zif", "bam dor hon kel pux zif"]


def play(env, engine, index=0, limits=None, sampling=None):
    problem = env.example("train", index)
    return asyncio.run(env.run_episode(engine, problem, sampling or SamplingArgs(), limits))


def right_answers(env, index, split="train"):
    return expected_answers(env.turns(split, index))


# ---- data -----------------------------------------------------------------------------------


def test_an_example_is_the_same_for_the_same_seed_split_and_index_and_differs_otherwise():
    env = AlphabetSortEnv()
    assert env.example("train", 5) == AlphabetSortEnv().example("train", 5)
    others = [
        env.example("train", 6),
        env.example("eval", 5),
        AlphabetSortEnv(seed=1).example("train", 5),
    ]
    assert all(other.info["turns"] != env.example("train", 5).info["turns"] for other in others)


def test_the_train_split_wraps_at_num_train_and_eval_has_num_eval_examples():
    env = AlphabetSortEnv(num_train=10, num_eval=7)
    assert env.example("train", 13) == env.example("train", 3)
    assert (env.num_examples("train"), env.num_examples("eval")) == (10, 7)
    assert AlphabetSortEnv().num_examples("train") is None


@pytest.mark.parametrize("distinct_initials", [True, False])
def test_each_turn_brings_distinct_words_of_the_asked_length(distinct_initials):
    env = AlphabetSortEnv(
        num_turns=4, words_per_turn=3, word_len=2, distinct_initials=distinct_initials
    )
    for index in range(50):
        turns = env.turns("train", index)
        words = [w for turn in turns for w in turn]
        assert [len(turn) for turn in turns] == [3] * 4
        assert all(len(w) == 2 and w.isalpha() and w.islower() for w in words)
        assert len(set(words)) == len(words)
        if distinct_initials:
            assert len({w[0] for w in words}) == len(words)


def test_the_prompt_is_the_system_prompt_and_the_first_words_and_the_answer_the_final_order():
    env = AlphabetSortEnv()
    problem = env.example("eval", 0)
    turns = problem.info["turns"]
    assert [(m.role, m.content) for m in problem.messages] == [
        ("system", SYSTEM_PROMPT),
        ("user", " ".join(turns[0])),
    ]
    assert problem.answer == " ".join(sorted(w for turn in turns for w in turn))


def test_arguments_that_cannot_make_an_episode_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="distinct_initials = false"):
        AlphabetSortEnv(num_turns=9, words_per_turn=3)
    with pytest.raises(ValueError, match="must be >= 1"):
        AlphabetSortEnv(num_turns=0)


def test_the_package_registers_alphabet_sort_as_an_entry_point():
    env = load_environment("alphabet-sort", {"num_turns": 2, "seed": 3})
    assert isinstance(env, AlphabetSortEnv)
    assert (env.num_turns, env.max_turns, env.seed) == (2, 2, 3)


# ---- reward ---------------------------------------------------------------------------------


def test_the_right_order_every_turn_scores_1():
    assert expected_answers(TURNS) == RIGHT
    score = episode_score(RIGHT, TURNS)
    assert score.reward == 1.0
    assert score.components == {"similarity": 1.0, "final": 1.0, "exact": 1.0}
    assert score.completion_text == RIGHT[-1]


def test_spacing_does_not_count_but_order_and_spelling_do():
    assert episode_score([" bam  kel", "bam dor\nkel zif ", RIGHT[2]], TURNS).reward == 1.0
    lazy = ["kel bam", "kel bam dor zif", "kel bam dor zif pux hon"]
    misspelt = ["bam kel", "bam dor kel zif", "bam dor hon kel pux zaf"]
    lazy_score, misspelt_score = episode_score(lazy, TURNS), episode_score(misspelt, TURNS)
    assert 0.3 < lazy_score.reward < misspelt_score.reward < 1.0
    assert lazy_score.components["exact"] == 0.0
    assert misspelt_score.components["exact"] == pytest.approx(2 / 3)


def test_each_turn_counts_the_same_and_a_turn_never_answered_counts_0():
    half = episode_score(["bam kel"], TURNS)
    assert half.reward == pytest.approx(1 / 3)
    assert (half.components["final"], half.components["exact"]) == (0.0, pytest.approx(1 / 3))
    assert episode_score([], TURNS).reward == 0.0


# ---- episodes against the scripted engine ---------------------------------------------------


def test_an_episode_has_one_model_turn_per_env_turn_and_the_right_answers_score_1():
    env = AlphabetSortEnv()
    answers = right_answers(env, 0)
    engine = FakeEngine([Scripted(a) for a in answers])
    sample = play(env, engine)
    turns = env.turns("train", 0)
    assert (sample.num_turns, sample.stop_reason, sample.reward) == (3, "done", 1.0)
    assert [(m.role, m.content) for m in sample.messages] == [
        ("assistant", answers[0]),
        ("user", " ".join(turns[1])),
        ("assistant", answers[1]),
        ("user", " ".join(turns[2])),
        ("assistant", answers[2]),
    ]
    assert sample.completion_text == answers[2]


def test_the_trained_sequence_holds_every_answer_and_masks_the_environments_words():
    env = AlphabetSortEnv(num_turns=2)
    answers = right_answers(env, 1)
    engine = FakeEngine([Scripted(a) for a in answers])
    sample = play(env, engine, index=1)
    new_words = {"role": "user", "content": " ".join(env.turns("train", 1)[1])}
    bridge = render([new_words], generation_prompt=True)
    first, second = (list(a.encode()) + [IM_END] for a in answers)
    assert engine.requests[1]["turn"].prompt_token_ids == (
        sample.prompt_token_ids + first + list(b"\n") + bridge
    )
    assert sample.completion_token_ids == first + list(b"\n") + bridge + second
    assert sample.completion_mask == [1] * len(first) + [0] * (1 + len(bridge)) + [1] * len(second)


def test_wrong_answers_score_less_and_every_turn_is_still_played():
    env = AlphabetSortEnv()
    turns = env.turns("train", 2)
    lazy = [" ".join(w for turn in turns[: k + 1] for w in turn) for k in range(3)]
    sample = play(env, FakeEngine([Scripted(a) for a in lazy]), index=2)
    assert (sample.num_turns, sample.stop_reason) == (3, "done")
    assert sample.reward < 1.0
    assert sample.reward_components["similarity"] == sample.reward


def test_a_turn_cut_at_max_tokens_ends_the_episode_and_the_turns_left_count_0():
    env = AlphabetSortEnv()
    answers = right_answers(env, 0)
    cut = Scripted(answers[1][:5], finish_reason="length")
    sample = play(env, FakeEngine([Scripted(answers[0]), cut]))
    assert (sample.num_turns, sample.stop_reason) == (2, "length")
    assert sample.reward < 2 / 3 and sample.reward_components["final"] == 0.0


def test_the_tasks_max_turns_wins_over_the_episodes_length():
    env = AlphabetSortEnv()
    engine = FakeEngine([Scripted(a) for a in right_answers(env, 0)])
    sample = play(env, engine, limits=EpisodeLimits(max_turns=1))
    assert (sample.num_turns, sample.stop_reason) == (1, "max_turns")
    assert sample.reward == pytest.approx(1 / 3)


# ---- SFT demonstrations ---------------------------------------------------------------------


def test_a_demonstration_is_a_whole_episode_with_the_environments_prompt_and_words():
    import random

    env = AlphabetSortEnv()
    messages = demonstration(env, random.Random("x"), lazy_fraction=0.0)
    turns = env.generate(random.Random("x"))
    assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * 3
    assert [m["content"] for m in messages[1::2]] == [" ".join(t) for t in turns]
    assert [m["content"] for m in messages[2::2]] == expected_answers(turns)


def test_a_lazy_answer_appends_the_new_words_unsorted():
    assert lazy_answer("", ["kel", "bam"]) == "kel bam"
    assert lazy_answer("bam kel", ["dor", "zif"]) == "bam kel dor zif"


def test_the_demos_file_is_deterministic_and_about_lazy_fraction_of_its_answers_are_lazy(
    tmp_path, capsys
):
    main([str(tmp_path / "a.jsonl"), "--num", "400", "--lazy-fraction", "0.4"])
    main([str(tmp_path / "b.jsonl"), "--num", "400", "--lazy-fraction", "0.4"])
    text = (tmp_path / "a.jsonl").read_text()
    assert text == (tmp_path / "b.jsonl").read_text()
    wrong = total = 0
    for line in text.splitlines():
        messages = json.loads(line)["messages"]
        turns = [m["content"].split() for m in messages[1::2]]
        right = expected_answers(turns)
        answers = [m["content"] for m in messages[2::2]]
        wrong += sum(a != r for a, r in zip(answers, right, strict=True))
        total += len(answers)
    # a lazy answer is right by chance when the new words sort after the old ones, in order
    assert 0.2 < wrong / total < 0.4
    assert "400 episodes" in capsys.readouterr().out


# ---- prime-rl's arguments --------------------------------------------------------------------


def test_prime_rl_ranges_draw_turns_and_words_per_episode_within_the_bounds():
    env = AlphabetSortEnv(min_turns=2, max_turns=4, min_names_per_turn=1, max_names_per_turn=3)
    shapes = [[len(words) for words in env.turns("train", i)] for i in range(200)]
    assert {len(shape) for shape in shapes} == {2, 3, 4}
    assert {n for shape in shapes for n in shape} == {1, 2, 3}
    assert env.max_turns == 4  # the episode limit when the task sets none
    assert shapes == [[len(words) for words in env.turns("train", i)] for i in range(200)]


def test_fixed_turns_draw_the_same_words_as_without_ranges():
    fixed = AlphabetSortEnv(min_turns=3, max_turns=3, min_names_per_turn=2, max_names_per_turn=2)
    assert [fixed.turns("train", i) for i in range(20)] == [
        AlphabetSortEnv().turns("train", i) for i in range(20)
    ]


def test_similarity_power_per_turn_or_on_the_mean():
    lazy = ["kel bam", "kel bam dor zif", "kel bam dor zif pux hon"]
    plain = episode_score(lazy, TURNS)
    per_turn = episode_score(lazy, TURNS, power=4)
    on_mean = episode_score(lazy, TURNS, power=4, per_turn=False)
    assert per_turn.reward < plain.reward and on_mean.reward == pytest.approx(plain.reward**4)
    assert per_turn.components["similarity"] == plain.reward  # the ratio, before the power
    assert episode_score(RIGHT, TURNS, power=8).reward == 1.0


def test_bad_ranges_and_powers_are_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="min_turns <= max_turns"):
        AlphabetSortEnv(min_turns=4, max_turns=2)
    with pytest.raises(ValueError, match="distinct_initials"):
        AlphabetSortEnv(max_turns=6, max_names_per_turn=5)
    with pytest.raises(ValueError, match="similarity_power"):
        AlphabetSortEnv(similarity_power=0)
