"""peft's LoRA on a Hugging Face experts module's 3-D weights (``LoraConfig(target_parameters=...)``) on
the expert rings: each ring step adds its block's low-rank update to the block's weights it carries.

peft adapts a parameter with a ``ParamWrapper`` around the module that holds it, nested once per
targeted parameter (``mlp.experts`` becomes wrapper(wrapper(experts))). Its forward registers a
``torch.nn.utils.parametrize`` on the experts' weight for the call, ``W + scaling · lhs @ rhs`` per
expert (one ``baddbmm`` over the experts), then calls the experts. That cannot run on the rings: the
parametrization replaces the sharded parameter for the whole call, where a ring holds one block of
experts per step. So the rings take the outermost wrapper's call instead (its class is swapped, not
the experts': ``ExpertRing.call_site``), and each ring step's product with an adapted weight (the up
projection's ``gate_up_proj``, the down projection's ``down_proj``; the forward's one ring, or that
projection's ring in backward) adds the update itself, for the block's experts only, to the block's
weight first (``ExpertStage.product``).

The adapters are small (``r`` rows per expert) and used whole at every step, like a planned
sub-block's LoRA adapters (``_sub_block.py``): gathered, then the step's part of them installed (the
``per_shard`` parameters with ``shard_parts`` of the projection whose weight they adapt), their
gradients summed over the steps and reduced like a norm's. peft lays them out per expert: ``lora_A``
is ``[experts · r, in]``, expert e's rows ``e·r .. (e+1)·r``; ``lora_B`` is ``[out, r · experts]``,
expert e's columns ``j·experts + e`` (``reshape(out, r, experts)``). A block's part keeps those
layouts for the block's experts, and peft's own ``get_delta_factors`` turns it into the step's
factors, with the wrapper's ``num_experts`` the block's size for the call.

Pitfalls:
- Only the adapters a wrapper has active apply, none under ``disable_adapter()``; adapters merged into
  the weights (``merge_adapter()``) are refused at the call: the merged update would be added again.
- The call that shards the experts must see the wrappers around them (the decoder layer's, or the
  outermost wrapper's, which is what ``layer.mlp.experts`` is under peft): a call of its own on the
  experts module or an inner wrapper cannot, and the wrappers' own forward would then fold the update
  into the sharded weight. Refused at the ``rsdp_shard`` call that reaches the wrappers.
- peft's wrappers around anything but Hugging Face's marked experts (Llama-4's, a Linear's weight) are
  refused: their parametrization would replace a sharded parameter for the call.
- A wrapper must adapt a ``[experts, ...]`` 3-D weight of the experts module itself; peft's 2-D case (an
  expert bias ``[experts, out]``, adapted as one Linear) mixes experts and is refused at ``rsdp_shard``.
- The update is folded in the weights' dtype with autocast off, as peft's parametrization folds it.
- A ring whose weights carry an update runs autograd through each step in its backward, the step's
  update and product computed again (the adapters' gradients flow through the updated weights), where
  the other rings compute their backward themselves (``_experts.py``); kept from the forward, each
  step's graph would save its updated weights, a copy of the whole projection over the W steps.
"""

import contextlib
import functools

import torch
import torch.nn as nn

from ._experts import ExpertsBlock, ExpertStage, Groups, is_experts_module


def peft_wrappers(experts: nn.Module, parents: dict[int, nn.Module]) -> list[nn.Module]:
    """peft's ``ParamWrapper`` modules around ``experts``, innermost first (``parents``: id(child) ->
    parent). A wrapper holds the module it adapts as ``base_layer`` and names the parameter
    (``parameter_name``)."""
    wrappers, inner = [], experts
    while (parent := parents.get(id(inner))) is not None and getattr(parent, "base_layer", None) is inner and hasattr(parent, "parameter_name"):
        wrappers.append(parent)
        inner = parent
    return wrappers


def check_wrappers_reach_their_experts(managed: list[nn.Module], nested: list[nn.Module], names: dict[int, str]) -> None:
    """Refuse peft's ``ParamWrapper`` (in ``managed``) around experts that an earlier ``rsdp_shard`` (or
    ``fully_shard``) call already manages (``nested``: the experts module itself, or an inner wrapper):
    the rings run the outermost wrapper's call, which that earlier call cannot see; and around anything
    but Hugging Face's experts (Llama-4's, a Linear's weight), whose parametrization would replace a
    sharded parameter for the call (see the module's pitfalls)."""
    nested_ids = {id(module) for module in nested}
    parents = {id(child): parent for parent in managed for child in parent.children()}
    for wrapper in filter(lambda module: hasattr(module, "parameter_name"), managed):
        inner, adapted = wrapper.base_layer, wrapper.get_base_layer()
        outermost = ([wrapper] + peft_wrappers(wrapper, parents))[-1]
        if not is_experts_module(adapted):
            raise ValueError(
                f"rsdp_shard: peft's LoRA on parameters of {names[id(adapted)]!r} ({type(adapted).__name__}; target_parameters) "
                "runs on the expert rings of Hugging Face's use_experts_implementation experts only. Shard "
                f"{names[id(outermost)]!r}, the outermost wrapper, with torch's fully_shard before this rsdp_shard call "
                f"(e.g. fully_shard(layer.{names[id(outermost)]}), then rsdp_shard(layer)), or adapt other modules."
            )
        if id(inner) in nested_ids:
            raise ValueError(
                f"rsdp_shard: peft's LoRA wrapper {names[id(wrapper)]!r} is around {names[id(inner)]!r}, which an earlier "
                "rsdp_shard or fully_shard call already shards; the expert rings add the adapters' update per block "
                f"only when they run the outermost wrapper's call. Shard the decoder layer (or {names[id(outermost)]!r}, "
                "the outermost wrapper) without a call of its own on the experts or an inner wrapper."
            )


class LoraExpertsBlock(ExpertsBlock):
    """A Hugging Face experts module under peft's ``ParamWrapper`` LoRA on its rings (see the module's
    docstring): called through its outermost wrapper, each step's adapted weights ``W + scaling · lhs @
    rhs`` for the block's experts."""

    def __init__(self, module: nn.Module, name: str, wrappers: list[nn.Module]):
        super().__init__(module, name)
        self.wrappers = wrappers
        self.call_site = wrappers[-1]
        slots = [name for _, name in self.param_slots]
        where = f"rsdp_shard: experts {name!r}"
        bad = [w.parameter_name for w in wrappers if w.parameter_name not in slots or getattr(module, w.parameter_name).dim() != 3]
        if bad:
            raise ValueError(
                f"{where} has peft LoRA on {bad}, which are not 3-D [experts, out, in] weights; LoRA on an expert ring "
                "adapts whole experts' matrices only. Drop them from target_parameters (e.g. keep "
                "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])."
            )
        self.adapter_linears = [linear for w in wrappers for linears in (w.lora_A, w.lora_B) for linear in linears.values()]
        for stage in self.stages:
            names = [name for _, name in stage.param_slots]
            # (wrapper, the operand it adapts) of this ring's adapted weights
            adapted = [(w, names.index(w.parameter_name)) for w in wrappers if w.parameter_name in names]
            if adapted:
                # Autograd through each step, computed again (see the module's pitfalls): the adapters'
                # gradients flow through the updated weights.
                stage.input_gradients = None
                stage.per_shard, stage.shard_parts = [], []
                for wrapper, _ in adapted:
                    self._add_parts(stage, wrapper.lora_A, wrapper.r, self._a_rows)
                    self._add_parts(stage, wrapper.lora_B, wrapper.r, self._b_columns)
                stage.product = functools.partial(self._updated_product, stage, adapted, stage.product)

    def _add_parts(self, stage: ExpertStage, linears: nn.ModuleDict, ranks: dict[str, int], part) -> None:
        """Each adapter Linear's parameters as ``stage``'s per-shard parameters, each step taking ``part``."""
        for adapter, linear in linears.items():
            for param_name, value in linear._parameters.items():
                if value is not None:
                    stage.per_shard.append((linear, param_name))
                    stage.shard_parts.append(functools.partial(part, rank=ranks[adapter]))

    def _layout(self):
        return self.stages[0].ring.ring.layout(self.experts)

    def _a_rows(self, full: torch.Tensor, shard: int, rank: int) -> torch.Tensor:
        """``lora_A``'s rows of the block's experts: ``[count · r, in]``."""
        layout = self._layout()
        return full[layout.start(shard) * rank : (layout.start(shard) + layout.rows_of(shard)) * rank]

    def _b_columns(self, full: torch.Tensor, shard: int, rank: int) -> torch.Tensor:
        """``lora_B``'s columns of the block's experts, in peft's order: ``[out, r · count]``."""
        layout = self._layout()
        start, count = layout.start(shard), layout.rows_of(shard)
        return full.reshape(full.shape[0], rank, self.experts)[:, :, start : start + count].reshape(full.shape[0], rank * count)

    def call_arguments(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        merged = [w.parameter_name for w in self.wrappers if w.merged]
        if merged:
            raise ValueError(
                f"rsdp: experts {self.name!r} have LoRA adapters merged into {merged}; on the expert rings each step "
                "adds the adapters' update itself. Call unmerge_adapter() first."
            )
        return super().call_arguments(args, kwargs)

    @staticmethod
    def _updated_product(stage: ExpertStage, adapted: list, product, rows: torch.Tensor, operands: list[torch.Tensor], groups: Groups) -> torch.Tensor:
        """``stage``'s step product with its block's adapted weights plus their active adapters' update
        for the block's experts (the adapters' parts for the block are installed: ``_Call.run``)."""
        operands = list(operands)
        for wrapper, slot in adapted:
            if wrapper.disable_adapters:
                continue
            # peft's factors are in the stored layout; a step's operand is [experts, in, out], the stored
            # weight viewed transposed where it is stored [experts, out, in].
            transposed = stage.transposed[slot]
            weight = operands[slot].mT if transposed else operands[slot]
            for adapter in [a for a in wrapper.active_adapters if a in wrapper.lora_A]:
                with _num_experts(wrapper, groups.count):
                    lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                with torch.autocast(weight.device.type, enabled=False):
                    weight = torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=scaling)
            operands[slot] = weight.mT if transposed else weight
        return product(rows, operands, groups)


@contextlib.contextmanager
def _num_experts(wrapper: nn.Module, count: int):
    """The wrapper's ``num_experts`` the block's, for peft's reshapes of the block's adapter parts."""
    before, wrapper.num_experts = wrapper.num_experts, count
    try:
        yield
    finally:
        wrapper.num_experts = before
