"""Hugging Face's ``Trainer`` (and TRL's trainers, which subclass it) on a model that rsdp shards.

``RSDPTrainerMixin`` goes in front of any ``transformers.Trainer`` subclass
(``class MyTrainer(RSDPTrainerMixin, SFTTrainer)``, or ``rsdp_trainer(SFTTrainer)``); the model passed
to it is already sharded, every rank alike: ``rsdp_shard`` per block and at the root, ``fully_shard``,
or any mix of the two from ``rsdp.parallelize``. Such a model owns its data parallelism, as one that
accelerate's FSDP2 plugin shards does, and the trainer must leave it to the model at each point where
it treats FSDP2 apart from DDP:

- wrapping: accelerate wraps every trainable model in DDP, which cannot hold DTensor parameters. The
  mixin prepares the model as accelerate prepares one for evaluation (autocast, compilation; no DDP,
  no device move).
- gradient accumulation: the Trainer's ``no_sync`` is DDP's. On every micro-step but the one before
  the optimizer step the mixin turns each rsdp / FSDP2 module's gradient reduction off
  (``set_requires_gradient_sync(False)``): each rank accumulates its own contribution unreduced and
  the synchronised backward reduces it with its own, so the step sees exactly the gradient of the whole
  accumulation window.
- clipping: accelerate's ``clip_grad_norm_`` already takes the norm of DTensor gradients over their
  mesh, the norm FSDP2 clips to.
- ``save_model``: the full state dict is gathered (a collective: every rank calls it, as the Trainer
  does) to CPU on rank 0, which writes it with ``save_pretrained``: safetensors (or a peft model's
  adapters) that ``from_pretrained`` loads in one process.
- checkpoints: the model and optimizer are saved with torch's distributed checkpoint (DCP), each rank
  writing its own shards, like accelerate's FSDP2 path; the scheduler by rank 0; the RNG states per
  rank by the Trainer itself. ``resume_from_checkpoint`` loads them back into the sharded model, so a
  resumed run continues the same trajectory.

Pitfalls:
- Every trainable parameter must be a DTensor that the model's sharding manages. A trainable plain
  tensor (the root ``rsdp_shard`` call forgotten, or LoRA adapters added after sharding, as
  ``SFTTrainer(peft_config=...)`` does) would train on each rank alone and drift: refused at construction.
- The Trainer must know it is distributed: on CPU that needs ``TrainingArguments(use_cpu=True)``;
  without it accelerate runs every rank as a single process on the whole data set. Refused too.
- fp16 with a gradient scaler is refused: each rank would find infs only in its own gradient shards
  and skip, or not skip, the step on its own. bf16 needs no scaler.
- accelerate's own sharding (``TrainingArguments(fsdp=...)``, a DeepSpeed config, or ``accelerate launch
  --use_fsdp / --use_deepspeed``) is refused: it would be a second owner of parameters the model's
  sharding already owns, and on CPU accelerate drops it without a word and trains as if it were absent.
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from transformers.trainer import SCHEDULER_NAME

from .._compat import DTensor, FSDPModule
from .._fully_shard import RSDPModule

# The DCP directory in each checkpoint, beside the Trainer's own files.
CHECKPOINT_DIR = "rsdp_checkpoint"


class RSDPTrainerMixin:
    """Put in front of a ``transformers.Trainer`` subclass to train a model sharded by ``rsdp_shard``,
    ``fully_shard`` or ``rsdp.parallelize`` (see the module docstring for what changes and why)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_training_setup(self.model, self.args)

    def _wrap_model(self, model, training=True, dataloader=None):
        # Autocast and compilation as accelerate applies them, without DDP; prepare_model marks the model
        # prepared, so the Trainer's later accelerator.prepare(model, optimizer) leaves it as it is.
        return self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)

    def training_step(self, model, inputs, *args, **kwargs):
        # The Trainer marks the micro-step before each optimizer step with sync_gradients.
        sync = self.accelerator.sync_gradients or self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        with _gradient_sync(self.model, sync):
            return super().training_step(model, inputs, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Adapters alone for a peft model: gathering its frozen base would only be thrown away.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=_is_peft(self.model))
        state_dict = get_model_state_dict(self.model, options=options)
        self._save(output_dir, state_dict=state_dict)
        dist.barrier()  # the files are complete before any rank reads them
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = _torch_optimizer(self.optimizer)
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, optimizer),
        }
        dcp.save(state, checkpoint_id=os.path.join(output_dir, CHECKPOINT_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        dist.barrier()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.model if model is None else model
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=_checkpoint_dir(resume_from_checkpoint))
        set_model_state_dict(model, state["model"])

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = _torch_optimizer(self.optimizer)
        state = {"optimizer": get_optimizer_state_dict(self.model, optimizer)}
        dcp.load(state, checkpoint_id=_checkpoint_dir(checkpoint))
        set_optimizer_state_dict(self.model, optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def rsdp_trainer(trainer_class: type) -> type:
    """``trainer_class`` (``Trainer``, ``SFTTrainer``, ``DPOTrainer``, ...) with :class:`RSDPTrainerMixin`
    in front: ``rsdp_trainer(SFTTrainer)(model=sharded_model, args=..., train_dataset=...)``."""
    return type(f"RSDP{trainer_class.__name__}", (RSDPTrainerMixin, trainer_class), {})


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module, sync: bool):
    """Gradient reduction on (``sync``) or off in every rsdp and FSDP2 module of ``model``, on again after."""
    sharded = [m for m in model.modules() if isinstance(m, (RSDPModule, FSDPModule))]
    for module in sharded:
        module.set_requires_gradient_sync(sync, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_gradient_sync(True, recurse=False)


def check_training_setup(model: torch.nn.Module, args) -> None:
    """Raise if training ``model`` with ``args`` would be silently wrong (the module docstring's pitfalls)."""
    unmanaged = [name for name, param in model.named_parameters() if param.requires_grad and not isinstance(param, DTensor)]
    if unmanaged:
        raise ValueError(
            f"rsdp.integrations.transformers: trainable parameters {unmanaged[:4]}{' ...' if len(unmanaged) > 4 else ''} "
            "are not sharded: each rank would train its own copy on its own batches. Shard the whole model before "
            "building the trainer (rsdp_shard on each block, then on the root), and add LoRA adapters before "
            "sharding (peft.get_peft_model, not the trainer's peft_config)."
        )
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if args.world_size != world_size:
        raise ValueError(
            f"rsdp.integrations.transformers: the Trainer runs {args.world_size} data-parallel process(es) but the "
            f"model is sharded over {world_size} ranks, so each rank would read the whole data set. Launch with "
            "torchrun, and on CPU pass TrainingArguments(use_cpu=True), which makes accelerate run the ranks as one "
            "data-parallel job."
        )
    plugin = _accelerate_sharding(args)
    if plugin:
        raise ValueError(
            f"rsdp.integrations.transformers: {plugin} asks accelerate to shard the model, but the model's own "
            "rsdp_shard / fully_shard calls already shard it: two owners of the same parameters (on CPU, accelerate "
            "drops the plugin without a word and trains as if it were absent). Leave accelerate's FSDP and DeepSpeed "
            "off (no fsdp or deepspeed in TrainingArguments, no accelerate launch --use_fsdp / --use_deepspeed)."
        )
    if args.fp16:
        raise ValueError(
            "rsdp.integrations.transformers: fp16 needs a gradient scaler, which would find infs in each rank's own "
            "gradient shards and skip the step on some ranks only. Train in bf16 (TrainingArguments(bf16=True))."
        )


def _accelerate_sharding(args) -> str | None:
    """What asks accelerate to shard the model (its FSDP or DeepSpeed plugin), or ``None``."""
    if args.fsdp:
        return "TrainingArguments(fsdp=...)"
    if args.deepspeed:
        return "TrainingArguments(deepspeed=...)"
    for variable, flag in (("ACCELERATE_USE_FSDP", "--use_fsdp"), ("ACCELERATE_USE_DEEPSPEED", "--use_deepspeed")):
        if os.environ.get(variable, "false").lower() in ("1", "true", "yes", "on"):
            return f"accelerate launch {flag} ({variable}={os.environ[variable]})"
    return None


def _checkpoint_dir(checkpoint: str) -> str:
    path = os.path.join(checkpoint, CHECKPOINT_DIR)
    if not os.path.isdir(path):
        raise ValueError(
            f"rsdp.integrations.transformers: {checkpoint} has no {CHECKPOINT_DIR}/ (the sharded model and optimizer "
            "that an rsdp trainer saves): it was saved with save_only_model=True or by another trainer. Resume from a "
            "checkpoint of an rsdp trainer, or load the weights with from_pretrained before sharding."
        )
    return path


def _torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper: DCP's state dict helpers read its param groups."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
