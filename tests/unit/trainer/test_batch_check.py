"""batch_check: what makes a decoded batch unsafe to train on is named, a sound batch passes."""

import math

import pytest
from trainer_support import make_train_batch

from rlbus_trainer.batch_check import batch_problem

VOCAB = 300


def test_a_sound_batch_passes():
    assert batch_problem(make_train_batch(3, num_ranks=2), 3, VOCAB) is None


def edit(mutate):
    batch = make_train_batch(1)
    mutate(batch.micro_batches[0][0])
    return batch_problem(batch, 1, VOCAB)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda mb: mb.input_ids.__setitem__(0, VOCAB), "outside the vocabulary"),
        (lambda mb: mb.input_ids.__setitem__(0, -1), "outside the vocabulary"),
        (lambda mb: mb.advantages.pop(), "advantages has"),
        (lambda mb: mb.loss_mask.append(1), "loss_mask has"),
        (lambda mb: mb.advantages.__setitem__(-1, math.nan), "advantages are not all finite"),
        (lambda mb: mb.inference_logprobs.__setitem__(-1, -math.inf), "inference_logprobs"),
        (lambda mb: mb.temperatures.__setitem__(0, 0.0), "temperatures"),
        (lambda mb: mb.seq_lens.append(1), "seq_lens"),
    ],
)
def test_an_unsafe_micro_batch_is_named(mutate, words):
    problem = edit(mutate)
    assert problem is not None and words in problem and problem.startswith("micro-batch 0")


def test_empty_batches_and_wrong_steps_are_named():
    empty = make_train_batch(1)
    empty.micro_batches = [[]]
    assert "no micro-batches" in batch_problem(empty, 1, VOCAB)
    no_tokens = make_train_batch(1)
    for field in ("input_ids", "position_ids", "loss_mask", "advantages"):
        setattr(no_tokens.micro_batches[0][0], field, [])
    assert "input_ids is empty" in batch_problem(no_tokens, 1, VOCAB)
    assert "stored as step 2" in batch_problem(make_train_batch(1), 2, VOCAB)


def tree_parents(mb) -> list[int]:
    """Valid `parent_ids` for `mb`: each sequence a chain (the plain layout, written out)."""
    parents, start = [], 0
    for n in mb.seq_lens:
        parents += [-1, *range(start, start + n - 1)]
        start += n
    return parents


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda mb: None, None),
        (lambda mb: mb.parent_ids.pop(), "parent_ids has"),
        (lambda mb: mb.parent_ids.__setitem__(0, 0), "a sequence's first token has -1"),
        (lambda mb: mb.parent_ids.__setitem__(2, 2), "not an earlier token"),
        (lambda mb: mb.parent_ids.__setitem__(mb.seq_lens[0] + 1, 0), "not an earlier token"),
    ],
    ids=["sound", "short", "root", "self", "other-sequence"],
)
def test_shared_prefix_parents_must_stay_inside_their_sequence(mutate, words):
    def with_parents(mb):
        assert len(mb.seq_lens) >= 2 and mb.seq_lens[0] >= 3
        mb.parent_ids = tree_parents(mb)
        mutate(mb)

    problem = edit(with_parents)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem, problem
