"""wordle (environments/wordle): the feedback rules, the reward, its deterministic data, whole
games against the scripted engine of the multi-turn tests, and the SFT demonstrations."""

import asyncio
import json

import pytest
from env_packages import ensure_env_package

from rlbus.wire.tasks import EpisodeLimits, SamplingArgs
from rlbus_orchestrator.envs.registry import load_environment

ensure_env_package("rlbus_wordle", "wordle")

import rlbus_wordle  # noqa: E402
from rlbus_wordle.demos import demo_games, main  # noqa: E402
from rlbus_wordle.env import NOT_IN_LIST, WordleEnv, game_score, reply_to  # noqa: E402
from rlbus_wordle.game import (  # noqa: E402
    candidates,
    consistent,
    feedback,
    known_letters,
    render_feedback,
    word_list,
)
from unit.orchestrator.multiturn_fakes import IM_END, FakeEngine, Scripted, render  # noqa: E402


def make_env(**args):
    return WordleEnv(**args)


def play(env, engine, index=0, limits=None):
    problem = env.example("train", index)
    return asyncio.run(env.run_episode(engine, problem, SamplingArgs(max_tokens=6), limits))


def train_index_of(env, secret):
    """The first train example whose secret is `secret`."""
    return next(i for i in range(10_000) if env.secret("train", i) == secret)


# ---- the rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guess", "secret", "marks"),
    [
        ("cat", "cat", "GGG"),
        ("cat", "dog", "---"),
        ("cat", "tan", "-GY"),
        ("cat", "act", "YYG"),
        # repeated letters: greens first, then a Y only while the secret has an unmarked copy
        ("eel", "elf", "G-Y"),  # one e in elf, taken by the green
        ("eve", "bee", "Y-G"),  # the last e is green; the first takes bee's other e
        ("bee", "eve", "-YG"),
        ("all", "lab", "YY-"),  # one l in lab: only the first l is marked
        ("lab", "all", "YY-"),
        ("egg", "gem", "YY-"),  # one g in gem
        ("odd", "dog", "YY-"),
        ("too", "oot", "YGY"),
        ("ooo", "dog", "-G-"),  # the green takes dog's only o
    ],
)
def test_feedback_marks_each_letter_and_repeated_letters_only_as_often_as_the_secret_has_them(
    guess, secret, marks
):
    assert feedback(guess, secret) == marks


def test_the_model_reads_feedback_as_letter_mark_pairs():
    assert render_feedback("cat", feedback("cat", "tan")) == "c- aG tY"


def test_the_board_keeps_every_letter_placed_by_any_guess():
    history = [(g, feedback(g, "pan")) for g in ("cat", "pen", "dog")]
    assert known_letters(history[:1], 3) == ".a."
    assert known_letters(history, 3) == "pan"
    assert known_letters([], 3) == "..."


def test_the_reply_is_the_last_guess_s_marks_then_the_board_and_off_list_words_get_no_marks():
    words = word_list()
    assert reply_to(["cat"], "pan", words) == "c- aG t- | .a."
    assert reply_to(["cat", "dog"], "pan", words) == "d- o- g- | .a."
    assert reply_to(["cat", "qqq"], "pan", words) == f"{NOT_IN_LIST} | .a."


def test_a_word_is_consistent_when_it_would_have_given_every_mark_seen():
    history = [("cat", feedback("cat", "tan"))]
    assert consistent("tan", history)
    assert not consistent("cat", history) and not consistent("bat", history)
    assert set(candidates(word_list(), history)) == {
        w for w in word_list() if w[1] == "a" and "t" in w and w[2] != "t" and "c" not in w
    }


def test_the_word_list_is_three_letter_lowercase_words_without_repeats():
    words = word_list()
    assert 50 <= len(words) <= 300
    assert all(len(w) == 3 and w.isalpha() and w.islower() for w in words)
    assert len(set(words)) == len(words)


# ---- the reward -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guesses", "reward", "solved", "speed", "greens", "valid"),
    [
        (["cat"], 1.0, 1.0, 1.0, 1.0, 1.0),
        (["dog", "pen", "cat"], 0.92, 1.0, 0.6, 1.0, 1.0),
        (["dog", "pen", "fox", "sun", "hat", "cat"], 0.8, 1.0, 0.0, 1.0, 1.0),
        (["dog", "pen", "fox", "sun", "hat", "car"], 0.1 + 0.2 * 2 / 3, 0.0, 0.0, 2 / 3, 1.0),
        (["cab", "dog"], 0.1, 0.0, 0.0, 0.0, 1.0),  # partial credit is the last guess's
        (["xyz", "cat"], 0.5 + 0.2 * 0.8 + 0.2 + 0.05, 1.0, 0.8, 1.0, 0.5),
        (["cab", "cax"], 0.05, 0.0, 0.0, 0.0, 0.5),  # a word off the list gets no marks
        (["zzz", "cats", "", "qqq", "abc", "xyz"], 0.0, 0.0, 0.0, 0.0, 0.0),
    ],
)
def test_reward_is_for_solving_more_for_fewer_guesses_some_for_ending_close_and_for_valid_words(
    guesses, reward, solved, speed, greens, valid
):
    score = game_score(guesses, "cat", word_list(), max_turns=6)
    assert score.reward == pytest.approx(reward)
    assert score.components == pytest.approx(
        {
            "solved": solved,
            "speed": speed,
            "greens": greens,
            "valid": valid,
            "guesses": len(guesses),
        }
    )
    assert score.completion_text == " ".join(guesses)


# ---- data -----------------------------------------------------------------------------------


def test_secrets_are_deterministic_per_seed_split_and_index():
    a, b, other = make_env(), make_env(), make_env(seed=1)
    for split in ("train", "eval"):
        secrets = [a.secret(split, i) for i in range(40)]
        assert secrets == [b.secret(split, i) for i in range(40)]
        assert secrets != [other.secret(split, i) for i in range(40)]
    assert a.example("train", 7).answer == b.example("train", 7).answer == a.secret("train", 7)


def test_train_and_eval_secrets_are_disjoint_and_an_eval_pass_plays_each_eval_secret_once():
    for seed in (0, 1):
        env = make_env(seed=seed)
        assert not set(env.secrets["train"]) & set(env.secrets["eval"])
        assert sorted(env.secrets["train"] + env.secrets["eval"]) == sorted(env.words)
        assert {env.secret("train", i) for i in range(2000)} == set(env.secrets["train"])
        num_eval = env.num_examples("eval")
        assert sorted(env.secret("eval", i) for i in range(num_eval)) == env.secrets["eval"]
    assert make_env().secrets == make_env(seed=5).secrets  # the split does not move with seed
    assert make_env().num_examples("train") is None
    assert make_env(num_eval=8).num_examples("eval") == 8


def test_the_registry_and_load_environment_build_the_same_environment():
    env = load_environment("wordle", {"seed": 3, "max_turns": 4})
    assert isinstance(env, WordleEnv) and (env.seed, env.max_turns) == (3, 4)
    assert env.example("train", 0).messages[0].content == "Guess the 3-letter word in 4 tries."
    assert rlbus_wordle.load_environment(seed=3).secret("train", 5) == env.secret("train", 5)


@pytest.mark.parametrize(("args", "match"), [({"max_turns": 0}, "max_turns"), ({"eval_fraction": 1.0}, "eval_fraction")])  # fmt: skip
def test_bad_arguments_are_refused_naming_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        make_env(**args)


# ---- whole games ----------------------------------------------------------------------------


def test_a_game_gets_feedback_each_turn_and_ends_when_solved_trained_on_the_guesses_only():
    env = make_env()
    index = train_index_of(env, "pan")
    engine = FakeEngine([Scripted("cat"), Scripted(" Pan\n")])
    sample = play(env, engine, index)
    assert [m.content for m in sample.messages] == [
        "cat", "c- aG t- | .a.", " Pan\n", "pG aG nG | pan",
    ]  # fmt: skip
    assert (sample.stop_reason, sample.num_turns) == ("done", 2)
    assert sample.reward == pytest.approx(0.5 + 0.2 * 0.8 + 0.2 + 0.1)
    assert sample.reward_components["guesses"] == 2.0
    bridge = [*map(ord, "\n"), *render([{"role": "user", "content": "c- aG t- | .a."}], generation_prompt=True)]  # fmt: skip
    turn_1, turn_2 = [*b"cat", IM_END], [*b" Pan\n", IM_END]
    assert sample.completion_token_ids == turn_1 + bridge + turn_2
    assert sample.completion_mask == [1] * 4 + [0] * len(bridge) + [1] * 6
    assert sample.prompt_token_ids == render(
        [{"role": "user", "content": "Guess the 3-letter word in 6 tries."}], generation_prompt=True
    )


def test_an_unsolved_game_ends_after_max_turns_and_words_off_the_list_waste_a_turn():
    env = make_env(max_turns=3)
    index = train_index_of(env, "pan")
    sample = play(env, FakeEngine([Scripted("qqq"), Scripted("dog"), Scripted("fox")]), index)
    assert [m.content for m in sample.messages][1::2] == [
        f"{NOT_IN_LIST} | ...", "d- o- g- | ...", "f- o- x- | ...",
    ]  # fmt: skip
    assert (sample.stop_reason, sample.num_turns) == ("max_turns", 3)
    assert sample.reward == pytest.approx(0.1 * 2 / 3)  # fox shares no letter with pan


def test_a_task_limit_on_turns_wins_over_the_environment_s():
    env = make_env()
    index = train_index_of(env, "pan")
    engine = FakeEngine([Scripted(w) for w in ("dog", "fox", "pen", "cat")])
    sample = play(env, engine, index, limits=EpisodeLimits(max_turns=2))
    assert (sample.stop_reason, sample.num_turns) == ("max_turns", 2)


def test_a_guess_cut_at_max_tokens_ends_the_game_unsolved():
    env = make_env()
    sample = play(env, FakeEngine([Scripted("dogdogdog", finish_reason="length")]))
    assert (sample.stop_reason, sample.reward) == ("length", 0.0)


# ---- demonstrations -------------------------------------------------------------------------


def test_the_solver_only_guesses_words_consistent_with_the_feedback_so_far():
    env = make_env()
    games = demo_games(300, weak_fraction=0.0, sloppy_fraction=0.0)
    for game in games:
        assert game[0]["content"] == env.prompt
        guesses = [m["content"] for m in game[1::2]]
        replies = [m["content"] for m in game[2::2]]
        history = [(g, "".join(r.split()[i][1] for i in range(3))) for g, r in zip(guesses, replies, strict=False)]  # fmt: skip
        assert all(r.endswith(" | " + known_letters(history[: i + 1], 3)) for i, r in enumerate(replies))  # fmt: skip
        for turn, guess in enumerate(guesses):
            assert consistent(guess, history[:turn]), (game, turn)
        assert len(guesses) <= env.max_turns
        assert game[-1]["role"] == "assistant"
    num_solved = sum(g[-1]["content"] == env.secret("train", i) for i, g in enumerate(games))
    assert num_solved / len(games) > 0.8


def test_demo_games_are_the_environment_s_games_on_train_secrets():
    env = make_env()
    for index, game in enumerate(demo_games(50, weak_fraction=0.3)):
        secret = env.secret("train", index)
        guesses = [m["content"] for m in game[1::2]]
        for turn, reply in enumerate(game[2::2]):
            assert reply["content"] == reply_to(guesses[: turn + 1], secret, env.words)
        assert guesses[-1] == secret or len(guesses) == env.max_turns
        words = [g for g in guesses if not g.endswith("?")]
        assert all(g in env.words for g in words) and len(set(words)) == len(words)
        assert all(g.removesuffix("?") in env.words for g in guesses)


def test_sloppy_guesses_carry_a_question_mark_and_are_refused_as_not_in_list():
    games = demo_games(200, weak_fraction=0.0, sloppy_fraction=0.25)
    turns = [(g["content"], r["content"]) for game in games for g, r in zip(game[1::2], game[2::2], strict=False)]  # fmt: skip
    sloppy = [reply for guess, reply in turns if guess.endswith("?")]
    assert 0.15 < len(sloppy) / len(turns) < 0.35
    assert all(reply.startswith(NOT_IN_LIST) for reply in sloppy)


def test_weak_play_loses_more_games_than_the_solver():
    def num_lost(games):
        return sum(g[-1]["content"] != make_env().secret("train", i) for i, g in enumerate(games))

    weak = demo_games(300, weak_fraction=0.6, sloppy_fraction=0.0)
    sloppy = demo_games(300, weak_fraction=0.0, sloppy_fraction=0.4)
    solver = demo_games(300, weak_fraction=0.0, sloppy_fraction=0.0)
    assert min(num_lost(weak), num_lost(sloppy)) > num_lost(solver) + 20


def test_demos_cli_writes_the_same_messages_jsonl_each_time(tmp_path, capsys):
    for name in ("a.jsonl", "b.jsonl"):
        main([str(tmp_path / name), "--num-games", "20", "--seed", "3"])
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert lines == (tmp_path / "b.jsonl").read_text().splitlines() and len(lines) == 20
    assert {m["role"] for m in json.loads(lines[0])["messages"]} == {"user", "assistant"}
    assert "wrote 20 games" in capsys.readouterr().out
