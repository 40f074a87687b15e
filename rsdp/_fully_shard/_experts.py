"""A mixture-of-experts layer's experts as one ring: blocks of whole experts rotate, the tokens stay.

Hugging Face stores a MoE layer's experts as 3-D parameters, ``[experts, out, in]`` (``gate_up_proj``,
``down_proj``, gpt-oss's biases ``[experts, out]``), in a module its ``use_experts_implementation``
decorator marks (``has_gate``, ``has_bias``, ``_is_expert_parallel``, ``num_experts``). rsdp stores each
``Shard(0)``, so rank r owns the same block of experts in every one: ``torch.chunk`` rows, so 8 experts
on 3 ranks are blocks of 3, 3 and 2.

A ring step over a block is the computation of one expert-parallel rank, with the weights moving
instead of the tokens: the module's own forward runs with the block's weights installed (plain
tensors) and ``num_experts`` the block's size, on the rank's own tokens, with ``top_k_index``
renumbered into the block (``index - start``) and every token-expert pair routed outside the block
masked. The W partial outputs sum to the layer's output. Every rank runs all W steps whatever the
routing, so ranks that route differently make the same exchanges. The ring itself (the W steps, the
backward's second rotation with each block's gradient partial summed on its way to the owner) is the
planned sub-block's (``_sub_block.py``); this file says what a step of experts is. What every experts
module on a ring shares (its per-expert parameters' segments, installing a block for a step) is
``ExpertRing``; torchtitan's ``GroupedExperts`` are its other kind (``_grouped_experts.py``).

Masking, per implementation Hugging Face dispatches to (``config._experts_implementation``):

- ``grouped_mm`` and ``batched_mm`` honour expert parallelism's sentinel: with ``_is_expert_parallel``
  set, a pair whose index is ``num_experts`` is left out of the GEMMs (grouped_mm) or zeroed
  (batched_mm, which still computes it);
- the eager loops do not all accept the sentinel (gpt-oss's ``one_hot`` has ``num_experts`` classes), so
  there a masked pair is routed to the block's first expert with routing weight zero: exact, but it
  costs that pair's compute at every step;
- in all three the routing weights of masked pairs are zeroed before the forward (``masked_fill``,
  inside the graph), so the router's gradient is exact whatever the implementation does with them.

Pitfalls:
- The forward keeps no per-step graphs: the experts' code saves views of the weights
  (``w[expert_idx]``, ``w.transpose``), which would not follow a kept graph's leaves when those are
  pointed at the backward's ring buffer. Each backward step runs the block's forward again, as under
  activation checkpointing.
- The experts may hold no parameters but their ``[experts, ...]`` ones (no post-expert norm), and
  no implementation but the three above (a kernel's own layout, fp8 weights): both refused at
  ``rsdp_shard``/first call, naming what to change.
"""

import inspect

import torch
import torch.nn as nn

from ._param import shard_layout
from ._wire import Segment, segment

# The experts implementations whose masking this file knows (see the docstring); None is what Hugging
# Face uses when the experts module runs outside a model (its own forward, the eager loop).
_SENTINEL_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
_EAGER_IMPLEMENTATIONS = ("eager", None)
_MARKERS = ("has_gate", "has_bias", "_is_expert_parallel", "num_experts", "config")


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face experts module (decorated ``use_experts_implementation``)."""
    return all(hasattr(module, marker) for marker in _MARKERS) and any(p.dim() == 3 for p in module.parameters(recurse=False))


class ExpertRing:
    """An experts module on a ring: its parameters (every one ``[experts, ...]``, ``Shard(0)`` over one
    layout, the experts') and how a block of them is installed for a step. Subclasses say what a call's
    arguments are (``call_arguments``) and what a step computes (``run_step``): Hugging Face's experts
    here, torchtitan's ``GroupedExperts`` in ``_grouped_experts.py``.

    The interface the sub-block ring (``_sub_block.py``) drives: ``param_slots``, ``per_shard``,
    ``param_transposed``, ``transposed``, ``segments``, ``keeps_graphs``, ``call_arguments``,
    ``run_step``, ``finish``."""

    keeps_graphs = False  # see the module's pitfalls
    per_shard = shard_parts = ()  # no parameter is used whole at every step
    adapter_linears = ()  # LoRA adapters the steps use whole (peft's on the experts: _expert_lora.py)
    advice = ""  # what ends a sub-block's refusal: no ring_plan entry names an experts module

    def __init__(self, module: nn.Module, name: str, experts: int):
        self.module, self.name, self.experts = module, name, experts
        self.call_site = module  # the module whose call runs the ring (a LoRA wrapper's: _expert_lora.py)
        self.forward = type(module).forward  # the module's own forward, run once per block of experts
        self.signature = inspect.signature(self.forward)
        where = f"rsdp_shard: experts {name or type(module).__qualname__!r}"
        nested = [n for n, p in module.named_parameters() if "." in n]
        if nested:
            raise ValueError(
                f"{where} holds parameters in submodules ({nested}, a post-expert norm); its experts rotate as "
                "one ring, running its forward once per block of experts, so it may hold only [experts, ...] "
                "parameters. Shard that module with torch's fully_shard instead."
            )
        not_per_expert = [n for n, p in module.named_parameters() if p.dim() < 2 or p.shape[0] != experts]
        if not_per_expert:
            raise ValueError(
                f"{where}: parameters {not_per_expert} are not [num_experts={experts}, ...]; only per-expert "
                "parameters can rotate in blocks of experts. Shard that module with torch's fully_shard instead."
            )
        self.param_slots = [(module, n) for n, _ in module.named_parameters(recurse=False)]
        self.param_transposed = (False,) * len(self.param_slots)
        self.transposed = self.param_transposed
        self.ring = None
        self._segments: dict[tuple[torch.dtype, int], tuple[Segment, ...]] = {}

    def segments(self, dtype: torch.dtype, world: int) -> tuple[Segment, ...]:
        """Each parameter's block of experts, in ``param_slots`` order: one layout (the experts') for all."""
        key = (dtype, world)
        if key not in self._segments:
            layout = shard_layout(self.experts, world)
            self._segments[key] = tuple(
                segment(layout, getattr(module, name).shape[1:], dtype) for module, name in self.param_slots
            )
        return self._segments[key]

    def layout(self):
        """How the experts split into blocks over the ring's ranks."""
        return shard_layout(self.experts, self.ring.ring.size)

    def bound_arguments(self, args: tuple, kwargs: dict) -> list:
        """A call's arguments in the order of the module's forward, defaults applied."""
        bound = self.signature.bind(self.module, *args, **kwargs)
        bound.apply_defaults()
        return list(bound.arguments.values())[1:]

    def run_block(self, operands: list[torch.Tensor], arguments: tuple, **attributes):
        """The module's own forward on ``arguments`` with one block's parameters ``operands`` installed
        (plain tensors) and ``attributes`` set for the call (``num_experts``: the block's size)."""
        module = self.module
        installed = [module._parameters[name] for _, name in self.param_slots]
        before = {key: getattr(module, key) for key in attributes}
        for (_, name), operand in zip(self.param_slots, operands):
            module._parameters[name] = operand
        for key, value in attributes.items():
            setattr(module, key, value)
        try:
            return self.forward(module, *arguments)
        finally:
            for (_, name), value in zip(self.param_slots, installed):
                module._parameters[name] = value
            for key, value in before.items():
                setattr(module, key, value)

    def finish(self, total: torch.Tensor) -> torch.Tensor:
        return total


class ExpertsBlock(ExpertRing):
    """A Hugging Face experts module on a ring: a step is its forward on the rank's tokens, with the
    token-expert pairs routed outside the block masked (see the module's docstring)."""

    def __init__(self, module: nn.Module, name: str):
        super().__init__(module, name, module.num_experts)

    def call_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call's arguments as ``(hidden_states, top_k_index, top_k_weights)``, whatever the experts'
        forward names them (gpt-oss: ``router_indices``, ``routing_weights``); checked before the ring
        starts, so that every rank refuses at the same point."""
        implementation = getattr(self.module.config, "_experts_implementation", None)
        if implementation not in _SENTINEL_IMPLEMENTATIONS + _EAGER_IMPLEMENTATIONS:
            raise ValueError(
                f"rsdp: experts {self.name!r} run with experts implementation {implementation!r}; an expert ring "
                f"masks the experts a block lacks in {[*_SENTINEL_IMPLEMENTATIONS, 'eager']} only. Load the model "
                "with experts_implementation='grouped_mm' (or call set_experts_implementation('grouped_mm'))."
            )
        values = self.bound_arguments(args, kwargs)
        if len(values) != 3 or not all(isinstance(value, torch.Tensor) for value in values):
            raise ValueError(
                f"rsdp: experts {self.name!r} must be called with (hidden_states, top_k_index, top_k_weights) "
                f"tensors, as Hugging Face's MoE blocks call them; got {[type(v).__name__ for v in values]}."
            )
        return tuple(values), {}

    def run_step(self, call, arguments, shard: int, operands: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' forward on this rank's tokens for the block of experts ``shard`` (its parameters
        ``operands``); returns (output, partial output), the same tensor."""
        sentinel = self.module.config._experts_implementation in _SENTINEL_IMPLEMENTATIONS
        hidden_states, index, weights = arguments.args
        layout = self.layout()
        count = layout.rows_of(shard)
        local = index - layout.start(shard)
        outside = (local < 0) | (local >= count)
        local = local.masked_fill(outside, count if sentinel else 0)
        weights = weights.masked_fill(outside, 0)
        output = self.run_block(operands, (hidden_states, local, weights), num_experts=count, _is_expert_parallel=sentinel)
        return output, output
