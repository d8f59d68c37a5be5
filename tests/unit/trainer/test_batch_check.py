"""batch_check: what makes a decoded batch unsafe to train on is named, a sound batch passes."""

import math

import pytest

from rlbus_trainer.batch_check import batch_problem
from rlbus_trainer.testing import make_train_batch

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
