"""SFT data: messages-format conversations -> token ids + loss masks -> packed micro-batches.

Sources (`sft.data.path`):
- `reverse-text`: generated on the fly, 5-10 lowercase characters, the user asks to reverse the
  text and the assistant answers it reversed (or, for a `copy_fraction` share of the examples,
  copies it: mixed-quality demonstrations that leave RL something to fix). The prompt is the one
  of the orchestrator's `reverse-text` environment (a service never imports another, so the
  constant is repeated here: keep both in sync), so an SFT'd model starts RL on exactly the
  prompts it learned.
- `*.jsonl`: one `{"messages": [{"role": ..., "content": ...}, ...]}` per line.
- `*.parquet`: a `messages` column (needs `pyarrow`).
- a directory written by `datasets.Dataset.save_to_disk` (needs `datasets`).

Example `i` of step `s` is deterministic given the seed (`batch(step)`), so a resumed run picks up
the data exactly where its checkpoint left off, without saving a data cursor.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlbus.wire.batches import MicroBatch

if TYPE_CHECKING:  # names for annotations only: this module imports neither at run time
    import torch
    from transformers import PreTrainedTokenizerBase

    from rlbus_trainer.loss import LossInputs

REVERSE_TEXT_SYSTEM_PROMPT = "Reverse the text character by character."


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


def reverse_text_conversation(
    rng: random.Random, min_len: int = 5, max_len: int = 10, copy_fraction: float = 0.0
) -> list[dict[str, str]]:
    """One reverse-text conversation; with probability `copy_fraction` the answer is the text
    itself (a lazy demonstration) instead of its reversal."""
    text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
    answer = text if rng.random() < copy_fraction else text[::-1]
    return [
        {"role": "system", "content": REVERSE_TEXT_SYSTEM_PROMPT},
        {"role": "user", "content": text},
        {"role": "assistant", "content": answer},
    ]


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], loss_roles: list[str]
) -> Tokenized:
    """Token ids of the rendered chat, loss on the turns of `loss_roles` (content + end token).

    Each turn is the difference between the template rendered up to it and up to the turn before;
    the role header (`<|im_start|>assistant\\n`) of a loss turn is excluded from the loss.
    """
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] in loss_roles:
            header_end = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            header = header_end[len(rendered) :]
            ids_h = tokenizer.encode(header, add_special_tokens=False) if header else []
            ids += ids_h
            mask += [0] * len(ids_h)
            rendered = header_end
        upto = _render(tokenizer, messages[: i + 1])
        assert upto.startswith(rendered), "chat template is not prefix-stable"
        piece_ids = tokenizer.encode(upto[len(rendered) :], add_special_tokens=False)
        ids += piece_ids
        mask += [int(message["role"] in loss_roles)] * len(piece_ids)
        rendered = upto
    return Tokenized(ids, mask)


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = False,
) -> str:
    """The chat template's text of `messages`."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert isinstance(text, str)  # tokenize=False renders text
    return text


def _read_conversations(path: str) -> list[list[dict[str, str]]]:
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"sft data.path {path!r} does not exist: give a JSONL/Parquet file, a saved "
            "`datasets` directory, or the built-in 'reverse-text'"
        )
    if p.is_dir():
        try:  # optional: only a saved dataset needs it
            import datasets
        except ImportError as e:
            raise ValueError(
                f"data.path {path!r} is a directory: reading a saved dataset needs "
                "`datasets` (uv pip install datasets)"
            ) from e
        return [row["messages"] for row in datasets.load_from_disk(str(p))]
    if p.suffix == ".parquet":
        try:  # optional: only Parquet data needs it
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(
                f"data.path {path!r}: reading Parquet needs pyarrow (uv pip install pyarrow)"
            ) from e
        return pq.read_table(p, columns=["messages"]).to_pydict()["messages"]
    with open(p) as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


class SFTData:
    """Global batches of tokenized conversations, deterministic per (seed, step)."""

    def __init__(
        self,
        path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        loss_roles: list[str],
        batch_size: int,
        seed: int,
        split: str = "train",
        copy_fraction: float = 0.0,
    ) -> None:
        self.path, self.tokenizer, self.loss_roles = path, tokenizer, loss_roles
        self.batch_size, self.seed, self.split = batch_size, seed, split
        self.copy_fraction = copy_fraction
        self.conversations = None if path == "reverse-text" else _read_conversations(path)
        if self.conversations is not None and not self.conversations:
            raise ValueError(f"data.path {path!r} holds no conversations")
        self._order: tuple[int, list[int]] | None = None

    @property
    def num_examples(self) -> int | None:
        return None if self.conversations is None else len(self.conversations)

    def conversation(self, index: int) -> list[dict[str, str]]:
        """Example `index` of the data (the epochs are shuffled, each its own way)."""
        if self.conversations is None:
            rng = random.Random(f"sft-reverse-text/{self.seed}/{self.split}/{index}")
            return reverse_text_conversation(rng, copy_fraction=self.copy_fraction)
        epoch, pos = divmod(index, len(self.conversations))
        return self.conversations[self.epoch_order(epoch)[pos]]

    def epoch_order(self, epoch: int) -> list[int]:
        """The order of the examples in `epoch`, shuffled once per epoch and kept (shuffling the
        whole file again for each example made a step of 32 cost 32 shuffles)."""
        if self._order is None or self._order[0] != epoch:
            assert self.conversations is not None
            order = list(range(len(self.conversations)))
            random.Random(f"sft/{self.seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def batch(self, step: int) -> list[Tokenized]:
        """The global batch of step `step` (1-based)."""
        start = (step - 1) * self.batch_size
        return [
            tokenize_conversation(self.tokenizer, self.conversation(i), self.loss_roles)
            for i in range(start, start + self.batch_size)
        ]


def pack(samples: list[Tokenized], seq_len: int, *, pack: bool = True) -> list[MicroBatch]:
    """Greedy packing into rows of at most seq_len tokens (longer samples are truncated)."""
    rows: list[list[Tokenized]] = []
    used = 0
    for s in samples:
        s = Tokenized(s.input_ids[:seq_len], s.loss_mask[:seq_len])
        if rows and pack and used + len(s.input_ids) <= seq_len:
            rows[-1].append(s)
            used += len(s.input_ids)
        else:
            rows.append([s])
            used = len(s.input_ids)
    return [_micro_batch(row) for row in rows]


def _micro_batch(row: list[Tokenized]) -> MicroBatch:
    ids = [t for s in row for t in s.input_ids]
    n = len(ids)
    return MicroBatch(
        input_ids=ids,
        position_ids=[p for s in row for p in range(len(s.input_ids))],
        loss_mask=[m for s in row for m in s.loss_mask],
        advantages=[0.0] * n,
        inference_logprobs=[0.0] * n,
        temperatures=[1.0] * n,
        seq_lens=[len(s.input_ids) for s in row],
    )


def sft_loss(
    inputs: LossInputs, num_global_tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy on loss tokens, normalised by the step's global loss-token count."""
    mask = inputs.loss_mask
    denom = max(num_global_tokens, 1)
    loss = -(inputs.trainer_logprobs * mask).sum() / denom
    metrics: dict[str, torch.Tensor] = {}
    if inputs.entropy is not None:
        metrics["entropy"] = (inputs.entropy * mask).sum() / denom
    return loss, metrics
