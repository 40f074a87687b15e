"""Llama-4's experts (transformers' ``Llama4TextExperts``) on the expert rings (``_experts.py``): blocks of
whole experts rotate, the tokens stay.

Llama-4 routes densely: its MoE block (``Llama4TextMoe``) repeats every token once per expert, scaled by
that expert's router score (zero for the experts the token was not routed to), and calls the experts with
the ``[experts · tokens, hidden]`` rows, expert e's rows ``e·tokens .. (e+1)·tokens``. The experts
multiply each expert's rows by its weights with ``torch.bmm``, both weights stored ``[experts, in, out]``
(``gate_up_proj``: the gate's columns, then the up projection's), with ``up · act_fn(gate)`` between.
So the routing needs no sort: every expert has ``tokens`` rows, in expert order, and a ring step
multiplies its block's rows by its block's weights (``expert_product``, the products ``bmm`` computes,
summed in another order), the same exchanges on every rank; the output rows stay in the input's order.

Pitfalls:
- Every expert multiplies every token (zeros where it was not routed), as the stock experts do: the ring
  saves the weights' memory, not the dense routing's compute.
- The rings compute the stock forward, so a subclass that changes it is refused at ``rsdp_shard``.
- The module carries none of the markers of Hugging Face's other experts (``use_experts_implementation``:
  ``has_gate``, ``is_transposed``, ...): it is recognised by its class, looked up once transformers'
  Llama-4 module is imported (an instance can only exist then), never imported here.
- The router beside it (``Llama4Router``, a Linear of one row per expert) is gathered whole with the
  layer's vectors, as every router beside experts is (``_api._routers``).
"""

import sys

import torch
import torch.nn as nn

from ._experts import ExpertRing, Groups, expert_product


def _llama4_experts_class():
    module = sys.modules.get("transformers.models.llama4.modeling_llama4")
    return None if module is None else module.Llama4TextExperts


def is_llama4_experts(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Llama4TextExperts`` (or a subclass)."""
    stock = _llama4_experts_class()
    return stock is not None and isinstance(module, stock)


class Llama4ExpertsBlock(ExpertRing):
    """A ``Llama4TextExperts`` on its rings (see the module's docstring)."""

    stored_transposed = True  # [experts, in, out], as bmm takes them

    def __init__(self, module: nn.Module, name: str):
        stock = _llama4_experts_class()
        if type(module).forward is not stock.forward:
            raise ValueError(
                f"rsdp_shard: experts {name or type(module).__qualname__!r} ({type(module).__name__}) change "
                f"{stock.__qualname__}'s forward; the expert rings compute the stock one. Shard that module with "
                "torch's fully_shard instead."
            )
        super().__init__(module, name, module.num_experts, *self.ring_parameters(module))

    @staticmethod
    def ring_parameters(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The parameters of the up projection's ring and of the down projection's (the planner's too)."""
        return ("gate_up_proj",), ("down_proj",)

    @staticmethod
    def dropped_activation_bytes(module: nn.Module, args: tuple) -> int:
        """What the stock experts keep from forward to backward and the rings do not (the planner's): the
        activation's output and saved product, two ``[rows, inner]`` (SwiGLU's)."""
        rows = args[0].numel() // module.hidden_size
        return 2 * rows * module.down_proj.shape[1] * module.down_proj.element_size()

    def call_arguments(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """A call's ``hidden_states``: ``[experts · tokens, hidden]`` rows, checked before the rings start."""
        values = self.bound_arguments(args, kwargs)
        rows = values[0] if len(values) == 1 and isinstance(values[0], torch.Tensor) else None
        if rows is None or rows.numel() % (self.experts * self.module.hidden_size):
            raise ValueError(
                f"rsdp: experts {self.name!r} must be called with one tensor of [num_experts={self.experts} · tokens, "
                f"hidden_size={self.module.hidden_size}] rows, as Llama4TextMoe calls them; got "
                f"{[tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]}."
            )
        return values

    def routed(self, hidden_states: torch.Tensor) -> tuple:
        """The rows as they come (expert e's: the e-th of ``experts`` equal parts) and each expert's count."""
        rows = hidden_states.reshape(-1, self.module.hidden_size)
        counts = torch.full((self.experts,), rows.shape[0] // self.experts, dtype=torch.long, device=rows.device)
        return rows, counts, None

    def _product(self, rows: torch.Tensor, operands: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        """Each row times its expert's matrix, in the weight's dtype, as ``bmm`` multiplies them."""
        return expert_product(rows, operands[0], groups, operands[0].dtype)

    first_product = second_product = _product

    def activation(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = hidden.chunk(2, dim=-1)
        return up * self.module.act_fn(gate)

    def combine(self, output: torch.Tensor, restore: None) -> torch.Tensor:
        """The rows in the input's order already: the stock output's ``[experts · tokens, hidden]``."""
        return output
