"""`rlbus_trainer.attention`: which rows get a `Documents` layout and which a dense mask, and that
attention over `Documents` builds no [T, T] tensor in a forward and backward pass."""

import msgspec
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_support import make_train_batch

from rlbus_trainer import qwen3
from rlbus_trainer.attention import Documents, dense_mask, layout_of
from rlbus_trainer.tiny_model import build_tiny_model


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any torch op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor_of_a_step(model, width: int, attention) -> int:
    ids = torch.randint(0, 300, (1, width))
    pos = torch.arange(width)[None]
    with LargestTensor() as seen:
        model(input_ids=ids, position_ids=pos, attention_mask=attention).logits.sum().backward()
    return seen.numel


def test_attention_over_documents_builds_no_t_by_t_tensor(tmp_path):
    # hidden 32, 2 heads x 32, vocab 300: every activation and weight is well under T x T at
    # T = 640 (logits: 300 x 640), so only a mask or attention scores can reach it.
    path = build_tiny_model(
        tmp_path / "m", hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64
    )
    model = qwen3.load(path, torch.float32)
    width = 640
    documents = Documents.of_rows([[600, 30]], width)  # one long document, one short, 10 pads
    assert largest_tensor_of_a_step(model, width, documents) < width * width // 2
    mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None]  # the control
    assert largest_tensor_of_a_step(model, width, mask) >= width * width


def as_tree(mb):
    """The same row in the shared-prefix layout: each token's parent is the token before it."""
    starts = {sum(mb.seq_lens[:i]) for i in range(len(mb.seq_lens))}
    parents = [-1 if i in starts else i - 1 for i in range(len(mb.input_ids))]
    return msgspec.structs.replace(mb, parent_ids=parents)


def test_plain_rows_get_documents_and_tree_rows_the_dense_mask():
    rows = [r[0] for r in make_train_batch(1, num_ranks=3, num_sequences=4, seed=3).micro_batches]
    width = max(len(mb.input_ids) for mb in rows)
    layout = layout_of(rows, width, documents_ok=True)
    assert isinstance(layout, Documents)
    for lengths, mb in zip(layout.lengths, rows, strict=True):
        assert sum(lengths) == width
        assert list(lengths[:-1]) == mb.seq_lens[:-1] and lengths[-1] >= mb.seq_lens[-1]
    mask = layout_of(rows, width, documents_ok=False)  # a transformers model
    assert isinstance(mask, torch.Tensor) and mask.shape == (len(rows), 1, width, width)
    # A chain-shaped tree attends as the plain row does, but only through the dense mask.
    tree_mask = layout_of([as_tree(rows[0]), *rows[1:]], width, documents_ok=True)
    assert isinstance(tree_mask, torch.Tensor)
    torch.testing.assert_close(tree_mask, mask)
    assert torch.equal(dense_mask(rows, width), mask)


def test_padding_extends_the_last_document():
    assert Documents.of_rows([[3, 2], [5]], 5).lengths == ((3, 2), (5,))
    assert Documents.of_rows([[3], [1, 1]], 5).lengths == ((5,), (1, 4))
