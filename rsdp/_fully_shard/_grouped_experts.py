"""torchtitan's ``GroupedExperts`` on an expert ring: blocks of whole experts rotate, the tokens stay.

torchtitan stores a MoE layer's routed experts as 3-D parameters ``[experts, out, in]`` (``w1_EFD``,
``w2_EDF``, ``w3_EFD``; gpt-oss's ``GptOssGroupedExperts``: ``mlp1_weight_EGD``, ``mlp2_weight_EDF`` and
the biases ``mlp1_bias_EG``, ``mlp2_bias_ED``), and calls the module as ``experts(x_RD,
num_tokens_per_expert_E)`` with its routed tokens sorted by expert (the token dispatcher's argsort):
expert e's tokens are rows ``offsets[e-1]:offsets[e]`` of ``x_RD``, ``offsets`` the cumulative counts.
rsdp stores each parameter ``Shard(0)`` over the experts (``torch.chunk`` rows: 8 experts on 3 ranks are
blocks of 3, 3 and 2), so a block of experts owns one contiguous range of rows.

A ring step over a block is the module's own forward (its ``torch._grouped_mm`` over token offsets,
one grouped GEMM per weight over the block's whole experts; gpt-oss's biases and clamped activation)
with the block's weights installed (plain tensors), on the block's rows of ``x_RD`` and the block's
token counts. Its output fills those rows of the step's partial output, zeros elsewhere, so the W
partials sum to the layer's output exactly (each row is written by one step). Every rank runs all W
steps whatever its routing, so ranks that route differently make the same exchanges; a block that got
none of a rank's tokens runs its GEMMs on no rows. The ring (the W steps, the backward's second
rotation with each block's gradient partial summed on its way to the owner) is the sub-block ring's
(``_sub_block.py``), as for Hugging Face's experts (``_experts.py``, which also holds what both share).

Pitfalls:
- Each block's rows are host integers: the call reads the cumulative token counts at the W block
  boundaries once (``call_arguments``; one device-to-host copy per call on a GPU), and hands them to
  every step as a plain value.
- Rows of ``x_RD`` past the last expert's tokens (torchtitan's padding) get zeros, where the stock
  forward's grouped GEMM leaves them unwritten; torchtitan's combine never reads them.
- torchtitan's forward computes in bfloat16 whatever the parameters' dtype; so does each step, and a
  block's rows are bit for bit what the whole layer's grouped GEMM gives them (torch 2.13's CPU kernel
  runs each expert's group alone; a GPU kernel may tile them otherwise).
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._experts import ExpertRing


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether ``module`` is torchtitan's ``GroupedExperts`` (or a subclass: gpt-oss's). One can only
    exist once torchtitan's MoE module is imported, so it is looked up, never imported."""
    moe = sys.modules.get("torchtitan.models.common.moe")
    return moe is not None and isinstance(module, moe.GroupedExperts)


class GroupedExpertsBlock(ExpertRing):
    """A torchtitan ``GroupedExperts`` on a ring: a step is its forward on the rows of the block's experts."""

    def __init__(self, module: nn.Module, name: str):
        super().__init__(module, name, module.num_experts)

    def call_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call's arguments as ``(x_RD, num_tokens_per_expert_E, block_rows)``: ``block_rows[s]`` is
        the first row of block s's tokens (``block_rows[W]`` the end of the last): checked and read
        before the ring starts, so that every rank refuses at the same point."""
        values = self.bound_arguments(args, kwargs)
        tensors = len(values) == 2 and all(isinstance(value, torch.Tensor) for value in values)
        if not tensors or values[0].dim() != 2 or values[1].shape != (self.experts,) or values[1].is_floating_point():
            found = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]
            raise ValueError(
                f"rsdp: experts {self.name!r} must be called with (x_RD, num_tokens_per_expert_E): the routed tokens "
                f"sorted by expert and each of the {self.experts} experts' token count, as torchtitan's "
                f"RoutedExperts calls them; got {found}."
            )
        x, counts = values
        layout = self.layout()
        ends = F.pad(counts.cumsum(0), (1, 0))  # ends[e]: the first row of expert e's tokens
        starts = [layout.start(shard) for shard in range(layout.world)] + [self.experts]
        return (x, counts, tuple(ends[starts].tolist())), {}

    def run_step(self, call, arguments, shard: int, operands: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' forward on the rows of the block of experts ``shard`` (its parameters
        ``operands``), placed in a partial output as long as ``x_RD``; returns it twice (output, partial)."""
        x, counts, block_rows = arguments.args
        first, end = block_rows[shard], block_rows[shard + 1]
        experts = self.layout().row_slice(shard)
        output = self.run_block(operands, (x[first:end], counts[experts]), num_experts=experts.stop - experts.start)
        partial = F.pad(output, (0, 0, first, x.shape[0] - end))
        return partial, partial
