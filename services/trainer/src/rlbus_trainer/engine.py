"""The training core shared by RL (`service.py`) and SFT (`sft.py`).

    setup_distributed()            torch.distributed from torchrun's env (or a 1-rank group), gloo on CPU
    build_engine(config, world)    model (FSDP2 per layer + root on 2+ ranks), optimizer, lr schedule
    engine.train_step(mbs, fn)     forward/backward every micro-batch of this rank, clip, step
    engine.full_state_dict()       the whole model on rank 0 (final SFT model, export, LoRA publishing;
                                   full weights are published tensor by tensor: stream_state.py)

Micro-batches are `rlbus.wire.batches.MicroBatch` (packed: several sequences per row, each
attending within itself; in the shared-prefix layout, `parent_ids`, each token attends to its
ancestors and reads its logprob from its parent's logits). `attention.layout_of` describes who
attends to whom: rlbus's Qwen3 module gets plain rows as `Documents` (no [T, T] mask), the
shared-prefix layout and transformers models a dense mask. Consecutive rows
are stacked (padded) into one forward pass while rows x longest row <= `tokens_per_forward`,
which matters for tiny models where per-call overhead dominates. Every rank runs
the same number of forward/backward passes (FSDP2 collectives must match), so a rank with fewer
rows runs empty-loss padding passes.
Loss terms are normalised by the step's global loss-token count (or, for per-sample losses, its
global sample count); FSDP2 averages gradients over ranks, so each rank's loss is multiplied by
the world size to turn that average back into a sum.

With `loss.ref_kl_coef` > 0 each forward pass is followed by one of the reference model without
gradients, its logprobs going into `LossInputs.reference_logprobs`: under LoRA the same model
with its adapters off (`lora.adapters_disabled`, no memory), else a frozen copy of the initial
weights, sharded as the model (`reference.offload`: in host memory, moved to the device for each
pass; one rank only).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, cast

import structlog
import torch
import torch.distributed as dist

from rlbus.configs.trainer import TrainerConfig, TrainerModelConfig
from rlbus.netutil import free_port
from rlbus.wire.batches import MicroBatch
from rlbus_trainer import qwen3
from rlbus_trainer.attention import AttentionLayout, Documents, layout_of
from rlbus_trainer.full_offload import OptimizerInBackward
from rlbus_trainer.hf_dir import local_model_dir
from rlbus_trainer.lora import adapters_disabled, apply_lora
from rlbus_trainer.loss import (
    LossFn,
    LossInputs,
    num_loss_samples,
    sample_ids_of,
    token_logprobs_and_entropy,
)
from rlbus_trainer.optim import (
    LRSchedule,
    Optimizers,
    OptimizerStateOffload,
    build_optimizer,
    clip_grad_norm,
)

log = structlog.get_logger()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

EngineOptimizer = Optimizers | OptimizerStateOffload | OptimizerInBackward
"""What `build_engine` steps: plain, with its state offloaded, or stepping in backward."""


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(timeout_s: float | None = None) -> World:
    """Join torchrun's process group (or make a 1-rank one when started without torchrun).
    `timeout_s`: the deadline of every collective (torch's default when None)."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)  # None: torch's
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            # A 1-rank group through an explicit address, not RANK/MASTER_* in os.environ: those
            # would leak into every process this one starts later and make an `sft` or `trainer`
            # child believe it runs under torchrun.
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return World(dist.get_rank(), dist.get_world_size(), device)


def teardown_distributed() -> None:
    """Leave the process group (if this process joined one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def load_model(model_config: TrainerModelConfig, device: torch.device) -> torch.nn.Module:
    """A causal LM from a local directory or HF id (Qwen3, Llama, ...), in the configured dtype:
    rlbus's own module where `model.impl` allows and it covers the model (`rlbus_trainer.qwen3`:
    no transformers import), else transformers'."""
    model = load_native(model_config) if model_config.impl != "transformers" else None
    if model is None and model_config.impl == "rlbus":
        raise ValueError(
            f"model.impl = 'rlbus' covers local {qwen3.ARCHITECTURE} checkpoints with "
            f"default RoPE and full attention; {model_config.name} is not one: use "
            "model.impl = 'auto' or 'transformers'"
        )
    if model is not None:
        model.activation_checkpointing = model_config.activation_checkpointing
        log.info("model_loaded", impl="rlbus", architecture=qwen3.ARCHITECTURE)
        return model.to(device)
    # transformers is imported only when a model needs it: its model classes cost ~3 s of one
    # core to import (docs/trainer.md, "Model implementation").
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        model_config.name,
        dtype=DTYPES[model_config.dtype],
        trust_remote_code=model_config.trust_remote_code,
        attn_implementation="sdpa",
    )
    if getattr(model_config, "activation_checkpointing", False):
        hf_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    hf_model.config.use_cache = False
    log.info("model_loaded", impl="transformers", architecture=type(hf_model).__name__)
    # transformers declares .to() with functools.wraps(nn.Module.to): mypy reads it unbound
    return hf_model.to(device)  # type: ignore[arg-type]


def load_native(model_config: TrainerModelConfig) -> qwen3.Qwen3ForCausalLM | None:
    """rlbus's module for the model, or None when it has none (or the files are not local)."""
    if model_config.trust_remote_code:
        return None
    model_dir = local_model_dir(model_config.name)
    return None if model_dir is None else qwen3.load(model_dir, DTYPES[model_config.dtype])


def shard_model(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, norm, tied head).
    One rank has nothing to shard: the model stays a plain module, which spares the start-up
    importing FSDP and building DTensors (1.5 s of one core) and changes no number (the state
    dict and checkpoint helpers take both; tests/unit/trainer/test_ckpt.py)."""
    if world.world_size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh  # deferred: see the docstring
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.world_size,))
    for layer in model.get_submodule("model.layers").children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    num_loss_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0


class Engine:
    """Model + optimizer + schedule of one rank; `train_step` runs one optimizer step."""

    def __init__(
        self,
        config: TrainerConfig,
        world: World,
        model: torch.nn.Module,
        optimizer: EngineOptimizer,
        schedule: LRSchedule,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.config = config
        self.reference = reference
        """The frozen initial weights (full fine-tuning with ref_kl_coef > 0), else None."""
        self.use_reference = config.loss.ref_kl_coef > 0
        self.world = world
        self.model = model
        self.takes_documents = isinstance(model, qwen3.Qwen3ForCausalLM)
        """rlbus's own module: plain rows go in as `Documents`, not as a dense mask."""
        self.optimizer = optimizer
        self.schedule = schedule
        self.max_norm = config.optim.max_norm
        self.full_offload = isinstance(optimizer, OptimizerInBackward)

    # ---- one optimizer step -------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> StepResult:
        """Forward/backward this rank's micro-batches, then clip and step. Collective over ranks."""
        t0 = time.perf_counter()
        num_local_loss = sum(sum(mb.loss_mask) for mb in micro_batches)
        num_local_tokens = sum(len(mb.input_ids) for mb in micro_batches)
        num_local_samples = sum(num_loss_samples(mb) for mb in micro_batches)
        totals = torch.tensor(
            [num_local_loss, num_local_tokens, num_local_samples], dtype=torch.float64
        )
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        num_global_loss, num_global_tokens = int(totals[0]), int(totals[1])
        num_global_samples = int(totals[2])
        padded = self._groups(micro_batches)

        loss_sum = torch.zeros((), dtype=torch.float64)
        metric_sums: dict[str, torch.Tensor] = {}
        self.model.train()
        for i, mb in enumerate(padded):
            if isinstance(self.optimizer, OptimizerInBackward):
                self.optimizer.last_micro_batch = i == len(padded) - 1
            loss, metrics = self._forward_loss(mb, loss_fn, num_global_loss, num_global_samples)
            (loss * self.world.world_size).backward()
            loss_sum += loss.detach().double().cpu()
            for k, v in metrics.items():
                v64 = v.detach().double().cpu()
                metric_sums[k] = metric_sums[k] + v64 if k in metric_sums else v64
        t1 = time.perf_counter()

        grad_norm = (
            0.0 if self.full_offload else clip_grad_norm(self.model.parameters(), self.max_norm)
        )
        self.optimizer.step()
        self.optimizer.zero_grad()
        lr = self.schedule.lr
        self.schedule.step()
        t2 = time.perf_counter()

        names = sorted(metric_sums)
        reduced = torch.stack([loss_sum] + [metric_sums[k] for k in names])
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return StepResult(
            loss=float(reduced[0]),
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=num_global_tokens,
            num_loss_tokens=num_global_loss,
            metrics={k: float(v) for k, v in zip(names, reduced[1:], strict=True)},
            forward_backward_s=t1 - t0,
            optimizer_s=t2 - t1,
        )

    def _forward_loss(
        self,
        group: list[MicroBatch],
        loss_fn: LossFn,
        num_global_loss: int,
        num_global_samples: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One forward pass over a group of packed rows (padded to the longest), loss over all."""
        dev = self.world.device
        ids, pos, mask = self._padded_inputs(group)
        # The reference pass first: no FSDP2 forward without grad then sits between the training
        # forward and its backward.
        ref_logits = self._reference_logits(ids, pos, mask) if self.use_reference else None
        logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        logprobs, entropies, ref_logprobs = [], [], []
        sample_ids: list[list[int]] = []
        num_samples = 0  # in the rows before
        for b, mb in enumerate(group):  # per row: [T_b] each, pads dropped
            n = len(mb.input_ids)
            temps = torch.tensor(mb.temperatures, dtype=torch.float32, device=dev)
            parents = torch.tensor(mb.parent_ids, device=dev) if mb.parent_ids else None
            lp, ent = token_logprobs_and_entropy(logits[b, :n], ids[b, :n], temps, parents)
            logprobs.append(lp)
            entropies.append(ent)
            if ref_logits is not None:
                ref_lp, _ = token_logprobs_and_entropy(
                    ref_logits[b, :n], ids[b, :n], temps, parents
                )
                ref_logprobs.append(ref_lp)
            row_ids = sample_ids_of(mb)  # numbered on from the rows before: unique in the group
            sample_ids.append([num_samples + i for i in row_ids])
            num_samples += max(row_ids) + 1

        def flat(attr: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(
                [x for mb in group for x in getattr(mb, attr)], dtype=dtype, device=dev
            )

        inputs = LossInputs(
            trainer_logprobs=torch.cat(logprobs),
            inference_logprobs=flat("inference_logprobs", torch.float32),
            advantages=flat("advantages", torch.float32),
            loss_mask=flat("loss_mask", torch.bool),
            entropy=torch.cat(entropies),
            sample_ids=torch.tensor([i for row in sample_ids for i in row], device=dev),
            num_global_samples=num_global_samples,
            reference_logprobs=torch.cat(ref_logprobs) if ref_logprobs else None,
        )
        return loss_fn(inputs, num_global_loss)

    def _padded_inputs(
        self, group: list[MicroBatch]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionLayout]:
        """Token ids [B, T], positions [B, T] and the attention (`Documents`, or a mask
        [B, 1, T, T]) of a group of rows padded to the longest row, on the engine's device."""
        num_rows, width = len(group), max(len(mb.input_ids) for mb in group)
        ids = torch.zeros(num_rows, width, dtype=torch.long)
        pos = torch.zeros(num_rows, width, dtype=torch.long)
        for b, mb in enumerate(group):
            n = len(mb.input_ids)
            ids[b, :n] = torch.tensor(mb.input_ids)
            pos[b, :n] = torch.tensor(mb.position_ids)
        dev = self.world.device
        attention = layout_of(group, width, documents_ok=self.takes_documents)
        attention = attention if isinstance(attention, Documents) else attention.to(dev)
        return ids.to(dev), pos.to(dev), attention

    @torch.no_grad()
    def _reference_logits(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: AttentionLayout
    ) -> torch.Tensor:
        """[B, T, V] logits of the reference model: the base model (adapters off) under LoRA,
        else the frozen copy, brought to the device for the pass when it is offloaded."""
        if self.reference is None:  # LoRA: build_engine keeps no copy
            with adapters_disabled(self.model):
                return self.model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        offload = self.config.reference.offload and self.world.device.type != "cpu"
        with contextlib.ExitStack() as stack:
            if offload:
                self.reference.to(self.world.device)
                stack.callback(self.reference.to, "cpu")
            return self.reference(input_ids=ids, position_ids=pos, attention_mask=mask).logits

    def _groups(self, micro_batches: list[MicroBatch]) -> list[list[MicroBatch]]:
        """Rows stacked per forward pass (rows x longest row <= tokens_per_forward), padded with
        empty groups to the max count over ranks."""
        budget = self.config.tokens_per_forward
        groups: list[list[MicroBatch]] = []
        width = 0
        for mb in micro_batches:
            new_width = max(width, len(mb.input_ids))
            if groups and groups[-1] and new_width * (len(groups[-1]) + 1) <= budget:
                groups[-1].append(mb)
                width = new_width
            else:
                groups.append([mb])
                width = len(mb.input_ids)
        count = torch.tensor([len(groups)], dtype=torch.float64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return groups + [[make_padding_micro_batch()]] * (int(count) - len(groups))

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> float:
        """Mean loss over micro-batches of every rank without updating anything (validation)."""
        self.model.eval()
        total = torch.tensor(
            [
                sum(sum(mb.loss_mask) for mb in micro_batches),
                sum(num_loss_samples(mb) for mb in micro_batches),
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(total)
        padded = self._groups(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in padded:
            loss, _ = self._forward_loss(mb, loss_fn, int(total[0]), int(total[1]))
            loss_sum += loss.double().cpu()
        dist.all_reduce(loss_sum)
        return float(loss_sum)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model state on rank 0 (empty elsewhere), on the CPU. Collective."""
        if self.world.world_size == 1:  # a plain module (shard_model): its own state is whole;
            # importing torch.distributed.checkpoint costs 0.1-0.8 s at the first publish
            return {name: t.detach().cpu() for name, t in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return cast(dict[str, torch.Tensor], state)  # a model's state: tensors only


def make_padding_micro_batch() -> MicroBatch:
    """A 2-token micro-batch without loss tokens: keeps FSDP collectives matched across ranks."""
    return MicroBatch(
        input_ids=[0, 0],
        position_ids=[0, 1],
        loss_mask=[0, 0],
        advantages=[0.0, 0.0],
        inference_logprobs=[0.0, 0.0],
        temperatures=[1.0, 1.0],
        seq_lens=[2],
    )


def build_engine(config: TrainerConfig, world: World) -> Engine:
    """Model, FSDP2 sharding, optimizer (plain, state-offloaded or in-backward) and schedule."""
    torch.manual_seed(config.seed)
    model = load_model(config.model, world.device)
    reference = build_reference(config, world, model)
    if config.lora is not None:  # freezes the base: the optimizer sees adapters
        apply_lora(model, config.lora)
    model = shard_model(model, world)
    full = config.model.full_offload_config
    optimizer: EngineOptimizer
    if full is not None:
        optimizer = OptimizerInBackward(
            model, config.optim, backend=full.backend, numa_binding=full.numa_binding
        )
    else:
        optimizer = build_optimizer(config.optim, model)
        if config.model.optim_cpu_offload:
            optimizer = OptimizerStateOffload(optimizer)
    schedule = LRSchedule(config.scheduler, optimizer, config.max_steps)
    log.info(
        "engine_built",
        model=config.model.name,
        world_size=world.world_size,
        num_params=sum(p.numel() for p in model.parameters()),
        num_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        optim=config.optim.type,
        full_offload=full is not None,
        optim_cpu_offload=config.model.optim_cpu_offload,
    )
    return Engine(config, world, model, optimizer, schedule, reference)


def build_reference(
    config: TrainerConfig, world: World, model: torch.nn.Module
) -> torch.nn.Module | None:
    """The frozen copy of the initial weights that `loss.ref_kl_coef` needs under full
    fine-tuning, sharded as the model (in host memory with `reference.offload`, one rank only);
    None without a KL term or under LoRA, whose reference is the base model itself. Called
    before LoRA and sharding touch `model`."""
    if config.loss.ref_kl_coef == 0 or config.lora is not None:
        return None
    if world.world_size > 1 and config.reference.offload:
        raise ValueError(
            f"trainer.reference.offload needs one trainer rank ({world.world_size} here: a "
            "sharded reference stays on the device, 1/N of the weights per rank): drop "
            "reference.offload, or train LoRA adapters (`--trainer.lora`, whose reference costs "
            "nothing)"
        )
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    if config.reference.offload:
        reference.to("cpu")
    reference = shard_model(reference, world)  # as the model: each rank holds 1/N
    log.info("reference_model_built", offload=config.reference.offload)
    return reference


def torch_optimizers(optimizer: EngineOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside an `Optimizers` / `OptimizerStateOffload` (for DCP)."""
    assert isinstance(optimizer, (Optimizers, OptimizerStateOffload)), type(optimizer)
    return optimizer.optimizers


class CausalLM(Protocol):
    """What the trainer reads of its model besides `nn.Module`'s: rlbus_trainer.qwen3's and
    transformers' models both have it."""

    config: Any

    def get_input_embeddings(self) -> torch.nn.Module: ...


def vocab_size_of(model: torch.nn.Module) -> int:
    """Rows of the input embedding (what a token id must stay below), the config's as fallback."""
    lm = cast(CausalLM, model)
    embedding = lm.get_input_embeddings()
    return int(getattr(embedding, "num_embeddings", None) or lm.config.vocab_size)
