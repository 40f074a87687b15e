"""torchtitan's ``GroupedExperts`` on the expert rings (``_experts.py``): blocks of whole experts rotate,
the tokens stay.

torchtitan stores a MoE layer's routed experts as 3-D parameters ``[experts, out, in]`` (``w1_EFD``,
``w2_EDF``, ``w3_EFD``; gpt-oss's ``GptOssGroupedExperts``: ``mlp1_weight_EGD``, ``mlp2_weight_EDF`` and
the biases ``mlp1_bias_EG``, ``mlp2_bias_ED``), and calls the module as ``experts(x_RD,
num_tokens_per_expert_E)`` with its routed tokens sorted by expert (the token dispatcher's argsort):
expert e's tokens are rows ``offsets[e-1]:offsets[e]`` of ``x_RD``, ``offsets`` the cumulative counts.
So the routing is torchtitan's: the up projection is ``w1`` and ``w3`` (gpt-oss: ``mlp1`` and its
bias), the down projection ``w2`` (``mlp2`` and its bias), and a step computes its block's rows as the stock
forward computes them: ``torch._grouped_mm`` in bfloat16 whatever the parameters' dtype, SiLU(h1)·h3
(gpt-oss: torchtitan's ``swiglu`` with the module's clamp), the biases added in bfloat16.

Pitfalls:
- A block's rows are bit for bit what the whole layer's grouped GEMM gives them (torch 2.13's CPU
  kernel runs each expert's group alone; a GPU kernel may tile them otherwise).
- Rows of ``x_RD`` past the last expert's tokens (torchtitan's padding) get zeros, where the stock
  forward's grouped GEMM leaves them unwritten; torchtitan's combine never reads them.
- The rings compute the stock forward, so a subclass that changes it is refused at ``rsdp_shard`` (a
  converter's ``_grouped_mm``, MXFP8's), unless it says it only casts the output back to the input's
  dtype (``rsdp_output_like_input = True``: the CPU launcher's gpt-oss experts, ``rsdp.torchtitan._cpu``).
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._experts import ExpertRing, Groups, expert_product


def _moe_modules():
    """torchtitan's MoE modules, once imported (an instance can only exist then): looked up, never imported."""
    return sys.modules.get("torchtitan.models.common.moe"), sys.modules.get("torchtitan.models.gpt_oss.moe")


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether ``module`` is torchtitan's ``GroupedExperts`` (or a subclass: gpt-oss's)."""
    moe = _moe_modules()[0]
    return moe is not None and isinstance(module, moe.GroupedExperts)


class GroupedExpertsBlock(ExpertRing):
    """A torchtitan ``GroupedExperts`` (or gpt-oss's) on its rings."""

    def __init__(self, module: nn.Module, name: str):
        moe, gpt_oss = _moe_modules()
        self.gpt_oss = gpt_oss is not None and isinstance(module, gpt_oss.GptOssGroupedExperts)
        stock = gpt_oss.GptOssGroupedExperts if self.gpt_oss else moe.GroupedExperts
        cast_back = getattr(module, "rsdp_output_like_input", False)
        if type(module)._grouped_mm is not stock._grouped_mm or (type(module).forward is not stock.forward and not cast_back):
            raise ValueError(
                f"rsdp_shard: experts {name or type(module).__qualname__!r} ({type(module).__name__}) change "
                f"{stock.__qualname__}'s forward or grouped GEMM (a low-precision converter's); the expert rings "
                "compute the stock one. Shard that module with torch's fully_shard instead."
            )
        # gpt-oss's stock experts return bfloat16; the others, and a cast-back subclass, the input's dtype.
        self.output_like_input = cast_back or not self.gpt_oss
        if self.gpt_oss:
            self.swiglu, self.limit = gpt_oss.swiglu, module.swiglu_limit
        super().__init__(module, name, module.num_experts, *self.ring_parameters(module))

    @staticmethod
    def ring_parameters(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The parameters of the up projection's ring and of the down projection's (the planner's too)."""
        if hasattr(module, "mlp1_weight_EGD"):  # gpt-oss's
            return ("mlp1_weight_EGD", "mlp1_bias_EG"), ("mlp2_weight_EDF", "mlp2_bias_ED")
        return ("w1_EFD", "w3_EFD"), ("w2_EDF",)

    @staticmethod
    def dropped_activation_bytes(module: nn.Module, args: tuple) -> int:
        """What the stock experts keep from forward to backward and the rings do not (the planner's): the
        activation's output and saved product, two bfloat16 ``[routed rows, inner]`` (SwiGLU's)."""
        down = getattr(module, GroupedExpertsBlock.ring_parameters(module)[1][0])
        return 2 * args[0].shape[0] * down.shape[2] * 2

    def gradient_term(self, name: str) -> tuple[slice | None, torch.dtype | None]:
        """Weights multiply in bfloat16 (a bias is added in bfloat16 from its own dtype, so its gradient
        is summed in that); ``w1`` makes the first half of the up projection's columns, ``w3`` the second."""
        if getattr(self.module, name).dim() == 2:
            return None, None
        if name in ("w1_EFD", "w3_EFD"):
            width = self.module.w1_EFD.shape[1]
            return (slice(0, width) if name == "w1_EFD" else slice(width, 2 * width)), torch.bfloat16
        return None, torch.bfloat16

    def call_arguments(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """A call's ``(x_RD, num_tokens_per_expert_E)``, checked before the rings start, so that every
        rank refuses at the same point."""
        values = self.bound_arguments(args, kwargs)
        tensors = len(values) == 2 and all(isinstance(value, torch.Tensor) for value in values)
        if not tensors or values[0].dim() != 2 or values[1].shape != (self.experts,) or values[1].is_floating_point():
            found = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]
            raise ValueError(
                f"rsdp: experts {self.name!r} must be called with (x_RD, num_tokens_per_expert_E): the routed tokens "
                f"sorted by expert and each of the {self.experts} experts' token count, as torchtitan's "
                f"RoutedExperts calls them; got {found}."
            )
        return values

    def routed(self, x: torch.Tensor, counts: torch.Tensor) -> tuple:
        """torchtitan's tokens come sorted by expert: the rows as they are, and the input for the output's dtype."""
        return x, counts, x

    def _biased(self, rows: torch.Tensor, operands: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        """gpt-oss's projection: the bfloat16 grouped GEMM, each row's expert's bias added in bfloat16."""
        weight, bias = operands
        # Repeated per row as torchtitan repeats it: its backward sums each expert's rows as torchtitan's does.
        biases = bias.repeat_interleave(groups.tokens, dim=0, output_size=groups.rows)
        return expert_product(rows, weight, groups, torch.bfloat16) + biases.to(torch.bfloat16)

    def first_product(self, rows: torch.Tensor, operands: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        """The block's rows' up projection: ``[h1 | h3]`` (gpt-oss: ``mlp1``'s interleaved gate and up)."""
        if self.gpt_oss:
            return self._biased(rows, operands, groups)
        return torch.cat([expert_product(rows, weight, groups, torch.bfloat16) for weight in operands], dim=-1)

    def second_product(self, rows: torch.Tensor, operands: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        if self.gpt_oss:
            return self._biased(rows, operands, groups)
        return expert_product(rows, operands[0], groups, torch.bfloat16)

    def activation(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gpt_oss:
            return self.swiglu(hidden, limit=self.limit)
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up

    def combine(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return output.type_as(x) if self.output_like_input else output
