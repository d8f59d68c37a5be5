"""SFT data: messages-format conversations -> token ids + loss masks -> packed micro-batches.

Sources (`sft.data`; reading them: sft_sources.py):
- `reverse-text`: generated on the fly, 5-10 lowercase characters, the user asks to reverse the
  text and the assistant answers it reversed (or, for a `copy_fraction` share of the examples,
  copies it: mixed-quality demonstrations that leave RL something to fix). The prompt is the one
  of the orchestrator's `reverse-text` environment (a service never imports another, so the
  constant is repeated here: keep both in sync), so an SFT'd model starts RL on exactly the
  prompts it learned.
- `*.jsonl`: one `{"messages": [{"role": ..., "content": ...}, ...]}` per line.
- `*.parquet`: a `messages` column (needs `pyarrow`).
- a directory written by `datasets.Dataset.save_to_disk`.
- `data.name`: a Hugging Face dataset (hub or local HF cache), with subsets, splits and shares.
- `[[data.sources]]`: a weighted mixture of any of the above.
- `data.type = "fake"`: random tokens (FakeSFTData), for throughput runs.

Example `i` of step `s` is deterministic given the seed (`batch(step)`), so a resumed run picks up
the data exactly where its checkpoint left off, without saving a data cursor.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlbus.configs.sft import BUILT_IN_DATA, SFTDataConfig
from rlbus.wire.batches import MicroBatch
from rlbus_trainer.sft_sources import load_conversations

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
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], loss_roles: list[str]
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
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
) -> str:
    """The chat template's text of `messages`."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert isinstance(text, str)  # tokenize=False renders text
    return text


class SFTData:
    """Global batches of tokenized conversations, deterministic per (seed, step).

    `sources` are lists of conversations (None: the built-in reverse-text generator) drawn with
    the relative `weights`: example `i` comes from the source a seeded stream of draws gives it,
    and is the next one of that source's own shuffled epochs (each source cycles by itself, so
    a small source in a mixture repeats rather than ends it). One source is read in order of its
    shuffled epochs, as before mixtures existed.
    """

    def __init__(
        self,
        sources: list[list[list[dict[str, Any]]]] | None,
        tokenizer: PreTrainedTokenizerBase,
        *,
        loss_roles: list[str],
        batch_size: int,
        seed: int,
        weights: list[float] | None = None,
        split: str = "train",
        copy_fraction: float = 0.0,
    ) -> None:
        self.sources, self.tokenizer, self.loss_roles = sources, tokenizer, loss_roles
        self.batch_size, self.seed, self.split = batch_size, seed, split
        self.copy_fraction = copy_fraction
        self.weights = weights or [1.0] * len(sources or [])
        self._orders: dict[int, tuple[int, list[int]]] = {}
        self._draws: list[tuple[int, int]] = []
        """(source, position in that source's stream) of examples 0, 1, ... drawn so far."""
        self._counts = [0] * len(self.weights)
        self._rng = random.Random(f"sft-mixture/{seed}/{split}")

    @classmethod
    def from_config(
        cls,
        data: SFTDataConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int,
        seq_len: int,
    ) -> SFTData:
        """The training data `data` describes (`data.type = "fake"`: FakeSFTData, sequences of
        up to `seq_len` tokens)."""
        if data.type == "fake":
            return FakeSFTData(tokenizer, data, seed=seed, seq_len=seq_len)
        resolved = data.resolved_sources()
        common = dict(loss_roles=data.loss_roles, batch_size=data.batch_size, seed=seed)
        if data.is_built_in:
            return cls(None, tokenizer, copy_fraction=data.copy_fraction, **common)  # type: ignore[arg-type]
        return cls(
            [load_conversations(source) for source in resolved],
            tokenizer,
            weights=[source.weight for source in resolved],
            **common,  # type: ignore[arg-type]
        )

    @classmethod
    def validation(
        cls, data: SFTDataConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int
    ) -> SFTData | None:
        """The validation data (`data.val_path`), read with the training data's columns."""
        if not data.val_path:
            return None
        common = dict(loss_roles=data.loss_roles, batch_size=data.batch_size, seed=seed)
        if data.val_path == BUILT_IN_DATA:
            return cls(None, tokenizer, split="val", **common)  # type: ignore[arg-type]
        source = data.file_source(data.val_path)
        return cls([load_conversations(source)], tokenizer, split="val", **common)  # type: ignore[arg-type]

    @property
    def num_examples(self) -> int | None:
        return None if self.sources is None else sum(len(s) for s in self.sources)

    def conversation(self, index: int) -> list[dict[str, Any]]:
        """Example `index` of the data (the epochs are shuffled, each its own way)."""
        if self.sources is None:
            rng = random.Random(f"sft-reverse-text/{self.seed}/{self.split}/{index}")
            return reverse_text_conversation(rng, copy_fraction=self.copy_fraction)
        source, position = self.draw(index)
        conversations = self.sources[source]
        epoch, pos = divmod(position, len(conversations))
        return conversations[self.epoch_order(epoch, source)[pos]]

    def draw(self, index: int) -> tuple[int, int]:
        """(source, position in its stream) of example `index`; one source: (0, index)."""
        if len(self.weights) == 1:
            return 0, index
        while len(self._draws) <= index:
            source = self._rng.choices(range(len(self.weights)), weights=self.weights)[0]
            self._draws.append((source, self._counts[source]))
            self._counts[source] += 1
        return self._draws[index]

    def epoch_order(self, epoch: int, source: int = 0) -> list[int]:
        """The order of a source's examples in `epoch`, shuffled once per epoch and kept
        (shuffling the whole file again for each example made a step of 32 cost 32 shuffles)."""
        kept = self._orders.get(source)
        if kept is None or kept[0] != epoch:
            assert self.sources is not None
            order = list(range(len(self.sources[source])))
            key = f"sft/{self.seed}/{epoch}" if source == 0 else f"sft/{self.seed}/{source}/{epoch}"
            random.Random(key).shuffle(order)
            kept = self._orders[source] = (epoch, order)
        return kept[1]

    def batch(self, step: int) -> list[Tokenized]:
        """The global batch of step `step` (1-based)."""
        start = (step - 1) * self.batch_size
        return [
            tokenize_conversation(self.tokenizer, self.conversation(i), self.loss_roles)
            for i in range(start, start + self.batch_size)
        ]


class FakeSFTData(SFTData):
    """Random token sequences (`data.type = "fake"`), loss on every token: what the trainer's
    throughput is measured on without reading or tokenizing data. Deterministic per step."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, data: SFTDataConfig, *, seed: int, seq_len: int
    ) -> None:
        super().__init__(
            None, tokenizer, loss_roles=data.loss_roles, batch_size=data.batch_size, seed=seed
        )
        self.fake = data.fake
        self.vocab_size, self.seq_len = len(tokenizer), seq_len

    def batch(self, step: int) -> list[Tokenized]:
        rng = random.Random(f"sft-fake/{self.seed}/{step}")
        samples = []
        for _ in range(self.batch_size):
            n = self.seq_len if self.fake.length == "fixed" else rng.randint(2, self.seq_len)
            if self.fake.input_ids == "increasing":
                start = rng.randrange(self.vocab_size)
                ids = [(start + k) % self.vocab_size for k in range(n)]
            else:
                ids = [rng.randrange(self.vocab_size) for _ in range(n)]
            samples.append(Tokenized(ids, [0] + [1] * (n - 1)))
        return samples


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
