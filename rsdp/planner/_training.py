"""What a run trains, applied to the model ``rsdp plan`` counts: the dtype it keeps its parameters in,
the parameters it freezes, and LoRA adapters.

- **The training dtype** (``--training-dtype``, torchtitan's ``training.dtype``): the dtype of the
  parameters the run keeps, and so of their gradients and optimizer state. A published config.json's
  ``torch_dtype`` says how its weights were *stored*, not how a run trains them: a mixed-precision run
  (FSDP2's ``MixedPrecisionPolicy``, torchtitan's default) keeps fp32 parameters and computes with bf16
  copies, so the model is counted in fp32 whatever the file says, unless the run really keeps bf16
  parameters (pure-bf16 training, or a LoRA run's bf16 base).
- **Frozen parameters** (``--frozen PATTERN``; dotted-path globs over parameter names, as
  :func:`rsdp.parallelize`'s rules: ``*`` one segment, ``**`` any number): ``requires_grad`` off, so
  they have no gradient and no optimizer state, and the count sees what autograd then saves (a frozen
  Linear does not keep its input for a weight gradient).
- **LoRA** (``--lora-rank R``, ``--lora-targets NAME ...``): peft's LoRA adapters (dropout 0) on the
  Linears whose last name segment is a target (default: every Linear of the transformer blocks, not the
  head), every other parameter frozen, as ``peft.get_peft_model`` leaves a model.

Pitfalls:
- peft keeps adapters in fp32 beside a bf16 base; the cost model takes one dtype per part, so the
  training dtype is applied after the adapters, to every parameter (a bf16 LoRA run's adapters are
  bf16 too). Adapters are a fraction of a percent of the parameters: the difference is that small.
- The CLI's LoRA is peft's (a Hugging Face or peft run). torchtitan's ``dp_strategy=auto`` plans the
  model torchtitan built, with the run's own LoRA converter already applied: its frozen base is
  counted as it is.
"""

import torch
import torch.nn as nn

from ..policy import name_matches
from ._models import _block_stack

TRAINING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def as_trained(
    model: nn.Module, *, training_dtype: str = "fp32", lora_rank: int = 0, lora_targets: list[str] | None = None,
    frozen: list[str] = (),
) -> nn.Module:
    """``model`` (on the meta device) as the run trains it: LoRA adapters, frozen parameters, and every
    floating parameter in ``training_dtype``."""
    if lora_targets and not lora_rank:
        raise ValueError("rsdp plan: --lora-targets names the Linears LoRA adapts; give the adapters' --lora-rank too.")
    if lora_rank < 0:
        raise ValueError(f"rsdp plan: --lora-rank must be positive (or 0: no LoRA), got {lora_rank}.")
    if lora_rank:
        model = with_lora(model, lora_rank, lora_targets or block_linears(model))
    freeze(model, frozen)
    dtype = TRAINING_DTYPES[training_dtype]
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return model


def block_linears(model: nn.Module) -> list[str]:
    """The last name segments of the Linears in ``model``'s transformer blocks (``q_proj``, ``w1``, ...)."""
    stack, _ = _block_stack(model)
    return sorted({name.rsplit(".", 1)[-1] for name, module in stack.named_modules() if isinstance(module, nn.Linear)})


def with_lora(model: nn.Module, rank: int, targets: list[str]) -> nn.Module:
    """peft's LoRA adapters of ``rank`` on the Linears named ``targets`` (last name segments); every
    other parameter frozen."""
    try:
        import peft
    except ImportError as error:
        raise ValueError(f"rsdp plan: --lora-rank counts peft's LoRA, and peft cannot be imported ({error}); pip install peft.") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets))
    try:
        # On the meta device, without making them on the CPU first (a 70B model has 560 of them).
        on_meta = any(param.is_meta for param in model.parameters())
        return peft.inject_adapter_in_model(config, model, low_cpu_mem_usage=on_meta)
    except ValueError as error:
        raise ValueError(
            f"rsdp plan: --lora-targets {' '.join(targets)}: {error} (targets are the last segments of Linear names, "
            f"such as {', '.join(block_linears(model))})."
        ) from None


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """Turn off ``requires_grad`` of the parameters whose names match one of ``patterns``."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        matched = [name for name in names if name_matches(pattern, name)]
        if not matched:
            raise ValueError(
                f"rsdp plan: --frozen {pattern!r} matches no parameter (names look like {names[0]!r}; "
                "'*' matches one dotted segment, '**' any number)."
            )
        for name in matched:
            model.get_parameter(name).requires_grad_(False)
