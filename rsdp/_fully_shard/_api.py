"""``rsdp_shard``, used like FSDP2's ``fully_shard``, and ``RSDPModule``, the class it swaps in."""

import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._compat import (
    DTensor,
    FSDPModule,
    MixedPrecisionPolicy,
    get_module_state,
    insert_module_state,
    unwrap_activation_checkpoint,
)
from ._ddp_habits import check_same_weights, record_replacement, replaced, watch_state_dicts
from ._embedding import RingEmbedding
from ._expert_lora import LoraExpertsBlock, check_wrappers_reach_their_experts, peft_wrappers
from ._experts import ExpertRing, ExpertsBlock, RingExperts, is_experts_module
from ._grouped_experts import GroupedExpertsBlock, is_grouped_experts
from ._llama4_experts import Llama4ExpertsBlock, is_llama4_experts
from ._linear import RingLinear
from ._param import placements_for, shard_parameter
from ._context import share_ring_context
from ._ring import new_layer_tags
from ._ring_function import RingLayer
from ._state import RSDPState, rsdp_states_under
from ._sub_block import RingSubBlock, SubBlock, plan_sub_blocks

def rsdp_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    ring_plan: dict | None = None,
    ring_group_size: int = 1,
) -> nn.Module:
    """Shard ``module``'s parameters and rotate its Linear and Embedding weights on a ring.

    Apply it bottom-up, like ``fully_shard``: once per transformer block, then at the root. Each call
    manages the parameters of its subtree that no nested ``rsdp_shard``, ``fully_shard`` or
    ``replicate`` already manages. The root's call gives the model a ring context of its own
    (buffers, prefetch predictions, pending collectives: ``_context.py``), which no other model in the
    process touches. Every managed parameter becomes ``nn.Parameter(DTensor)`` with
    ``Shard(0)`` placement (``(Replicate(), Shard(0))`` on a 2-D mesh) under its original name.
    A mixture-of-experts module (``[experts, ...]`` parameters: Hugging Face's experts, torchtitan's
    ``GroupedExperts``) rotates in blocks of whole experts, each rank running its own tokens through the
    block it holds (``_experts.py``, ``_grouped_experts.py``).

    A module wrapped by ``checkpoint_wrapper`` (activation checkpointing, as torchtitan applies it) is
    sharded through its wrapped module, which becomes the :class:`RSDPModule`: recomputation in
    backward calls the wrapped module, and the gathered parameters must be installed then too.

    Args:
        module: the module to shard; its class becomes a subclass of :class:`RSDPModule`.
        mesh: 1-D (shard) or 2-D (replicate x shard) device mesh. ``None``: a 1-D mesh over the
            default process group on its device type (cpu for gloo, cuda for nccl).
        reshard_after_forward: for the parameters that are gathered whole, FSDP-style (vectors: norm
            weights, other biases): free them after forward and gather them again for backward
            (``True``), or keep them until the module's backward (``False``, the default: they cost one
            activation row each, and it saves an all-gather per step).
        mp_policy: torch's ``MixedPrecisionPolicy``: ``param_dtype`` for the rotated copies and the
            compute, ``reduce_dtype`` for the travelling gradient partials; the sharded parameters
            keep their own dtype.
        ring_plan: submodule name (globs; keys from an ancestor also match) -> ``"colwise"`` /
            ``"rowwise"`` (Hugging Face's ``base_model_tp_plan`` strings) or torchtitan's
            ``ColwiseParallel()`` / ``RowwiseParallel()``: each rowwise Linear and its colwise siblings
            rotate as one ring, their parent's whole forward per shard (``_sub_block.py``);
            ``"replicated_with_grad_allreduce"`` parameters inside (per-head q/k norms) run with each
            shard. Other entries leave their modules to rsdp's own sharding.
        ring_group_size: g, dividing the shard dimension's size W: the ranks form W/g groups of g
            consecutive ranks and the ring passes shards between groups, W/g steps per ring, each
            computing with a group's block (its g shards, all-gathered within the group; gradients
            reduce-scattered within it). 1 (the default) is a ring of ranks; W is one all-gather,
            FSDP's pattern. Parameters stay ``Shard(0)`` over all W ranks (docs/design.md, "A ring of
            groups"); on a 2-D mesh the groups form within each replica's shard dimension.

    Returns:
        ``module``, now an :class:`RSDPModule` (or the checkpoint wrapper around one).
    """
    mesh = _validated_mesh(mesh)
    wrapper, module = module, unwrap_activation_checkpoint(module)
    if wrapper is not module:
        rsdp_shard(
            module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, ring_plan=ring_plan,
            ring_group_size=ring_group_size,
        )
        return wrapper
    _check_not_managed(module)
    _check_ring_group_size(ring_group_size, mesh)
    managed, nested = _managed_and_nested_modules(module)
    names = {id(submodule): name or type(module).__qualname__ for name, submodule in module.named_modules()}
    check_wrappers_reach_their_experts(managed, nested, names)
    _refuse_routed_experts_without_rings(managed, names)
    state = RSDPState(module, mesh, mp_policy or MixedPrecisionPolicy(), ring_group_size)
    sub_blocks = _planned_sub_blocks(module, managed, ring_plan or {}, mesh, ring_group_size)
    column_split = {id(block.row.weight) for block in sub_blocks}
    # A planned sub-block's LoRA adapters are used whole at every ring step: gathered, matrices too.
    adapter_linears = {id(linear) for block in sub_blocks for linear in block.adapter_linears}
    slots = [(owner, name, param) for owner in managed for name, param in owner._parameters.items() if param is not None]
    key_prefixes = {id(submodule): f"{name}." if name else "" for name, submodule in module.named_modules()}
    newly_sharded = _newly_sharded(slots, key_prefixes)
    check_same_weights(module, newly_sharded, mesh, state.device)
    replacement = _sharded_parameters(slots, nested, mesh, state.device, column_split)
    for name, param in newly_sharded:
        record_replacement(param, replacement[id(param)], f"{type(module).__qualname__}.{name}")
    experts = _experts_blocks(managed, names)
    experts += [GroupedExpertsBlock(owner, names[id(owner)]) for owner in managed if is_grouped_experts(owner)]
    experts += [Llama4ExpertsBlock(owner, names[id(owner)]) for owner in managed if is_llama4_experts(owner)]
    # peft's LoRA on experts is used whole at every step too.
    adapter_linears |= {id(linear) for block in experts for linear in block.adapter_linears}
    planned = {id(m) for block in sub_blocks for m in (block.module, block.row, *block.columns)}
    whole = adapter_linears | _routers(managed, experts, planned)
    ring_slots = _make_ring_layers(state, managed, sub_blocks + experts, names, whole)
    _install_parameters(state, slots, replacement, ring_slots, column_split, names, reshard_after_forward, whole, bool(adapter_linears))

    insert_module_state(module, state)
    # A root over rsdp modules sharded before it: one context of their own for the model.
    states = rsdp_states_under(module)
    if len(states) > 1:
        share_ring_context(states)
    state.register_hooks(module)
    watch_state_dicts(module, [key_prefixes[id(owner)] + name for owner, name, _ in slots], mesh)
    _swap_class(module, RSDPModule, "RSDP")
    return module


def _experts_blocks(managed: list[nn.Module], names: dict[int, str]) -> list[ExpertsBlock]:
    """The Hugging Face experts modules of ``managed`` on rings of their own; those under peft's LoRA
    (``ParamWrapper``s around them, ``_expert_lora.py``) called through their outermost wrapper."""
    parents = {id(child): parent for parent in managed for child in parent.children()}
    blocks = []
    for owner in filter(is_experts_module, managed):
        wrappers = peft_wrappers(owner, parents)
        if wrappers:  # named as the model calls it: the outermost wrapper's name
            blocks.append(LoraExpertsBlock(owner, names[id(wrappers[-1])], wrappers))
        else:
            blocks.append(ExpertsBlock(owner, names[id(owner)]))
    return blocks


def _on_expert_rings(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module that rotates on expert rings of its own."""
    return is_experts_module(module) or is_grouped_experts(module) or is_llama4_experts(module)


@functools.cache
def _takes_routing(module_class: type) -> bool:
    """Whether ``module_class``'s forward takes ``top_k_index`` (Hugging Face's experts' routing)."""
    try:
        return "top_k_index" in inspect.signature(module_class.forward).parameters
    except (TypeError, ValueError):  # a forward with no Python signature
        return False


def _refuse_routed_experts_without_rings(managed: list[nn.Module], names: dict[int, str]) -> None:
    """Refuse experts modules called with routing (``top_k_index``, Hugging Face's experts signature) that
    no expert ring runs (LongCat-Flash's, Step-3's, DBRX's: no ``use_experts_implementation`` markers).
    Their forward uses the weights of only the experts its tokens reach, so op by op (``_operand.py``)
    each rank would gather a different number of times, and ranks that route differently would wait
    for each other until the collective timeout."""
    for owner in managed:
        if _takes_routing(type(owner)) and not _on_expert_rings(owner) and any(p.dim() >= 2 for p in owner.parameters()):
            name = names[id(owner)]
            raise ValueError(
                f"rsdp_shard: experts {name!r} ({type(owner).__name__}) are routed (top_k_index) but are not a kind the "
                "expert rings run (Hugging Face's use_experts_implementation experts, Llama-4's, torchtitan's "
                "GroupedExperts): op by op each rank would gather the weights of only the experts its tokens reach, "
                "and ranks that route differently would hang. Shard that module with torch's fully_shard instead, "
                f"before rsdp_shard on the module holding it (e.g. fully_shard(layer.{name}), then rsdp_shard(layer))."
            )


def _planned_sub_blocks(module: nn.Module, managed: list[nn.Module], ring_plan: dict, mesh: DeviceMesh, group: int) -> list:
    """The ring plan's sub-blocks of ``module``, each inside what this call manages."""
    sub_blocks = plan_sub_blocks(module, ring_plan, mesh.size(mesh.ndim - 1), group)
    managed_ids = {id(m) for m in managed}
    for block in sub_blocks:
        if any(id(m) not in managed_ids for m in (block.module, block.row, *block.columns)):
            raise ValueError(
                f"rsdp_shard: ring_plan sub-block {block.name!r} is inside a submodule another call already "
                "shards; give the plan to that call instead."
            )
    return sub_blocks


def _newly_sharded(slots: list, key_prefixes: dict[int, str]) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of each plain parameter in ``slots`` that no earlier call sharded (a tied one
    once): the ones this call shards from this rank's own full value."""
    found = {}
    for owner, name, param in slots:
        if not isinstance(param, DTensor) and param not in replaced and id(param) not in found:
            found[id(param)] = (key_prefixes[id(owner)] + name, param)
    return list(found.values())


def _sharded_parameters(slots: list, nested: list[nn.Module], mesh: DeviceMesh, device, column_split: set[int]) -> dict[int, nn.Parameter]:
    """id(parameter) -> its sharded replacement: a nested rsdp call's, kept, or a new ``Shard(0)``
    (``Shard(1)`` for a planned rowwise Linear's weight) DTensor parameter."""
    sharded_by_nested_calls = {
        id(param)
        for nested_root in nested
        if isinstance(get_module_state(nested_root), RSDPState)
        for param in nested_root.parameters()
    }
    replacement: dict[int, nn.Parameter] = {}
    for owner, name, param in slots:
        if id(param) in replacement:
            continue
        if id(param) in sharded_by_nested_calls and param.device_mesh == mesh:
            replacement[id(param)] = param
        else:
            dim = 1 if id(param) in column_split else 0
            replacement[id(param)] = _sharded(param, mesh, device, owner, name, dim)
    return replacement


def _routers(managed: list[nn.Module], experts: list[ExpertRing], planned: set[int]) -> set[int]:
    """The modules beside a call's experts that hold one row per expert in each parameter (a router: a
    score per expert, Hugging Face's ``TopKRouter`` or torchtitan's ``gate`` Linear): gathered whole with
    the vectors, in one all-gather for all, rather than rotated on a ring of their own (2(W-1) exchanges
    per step for a weight the size of one expert's row block)."""
    counts = {block.experts for block in experts}
    inside = {id(m) for block in experts for m in block.module.modules()} | planned
    return {
        id(owner)
        for owner in managed
        if id(owner) not in inside
        and any(p.dim() == 2 for p in owner.parameters(recurse=False))
        and all(p.shape[0] in counts for p in owner.parameters(recurse=False))
    }


def _ring_layer(state: RSDPState, name: str, carries_collectives: bool = True) -> RingLayer:
    """A new ring layer of ``state``'s module, handed what it runs with: the module's ring, gradient store
    and precision, and message tags of its own."""
    return RingLayer(state.ring, state.gradients, state.precision, new_layer_tags(), name, carries_collectives)


def _make_ring_layers(
    state: RSDPState, managed: list[nn.Module], blocks: list, names: dict[int, str], whole: set[int]
) -> set[tuple[int, str]]:
    """Give every ring module (Linear, Embedding, Conv1D), planned sub-block and experts module its ring
    layer and class; returns the (id(module), parameter name) slots whose weights those rings rotate. The
    modules in ``whole`` (a planned sub-block's LoRA adapters, which it uses whole; a router beside
    experts) rotate with none."""
    parents = {id(child): parent for parent in managed for child in parent.children()}
    rows = {id(block.row): block for block in blocks if isinstance(block, SubBlock)}
    ring_slots = set()
    for owner in managed:
        mixin = None if id(owner) in whole else ring_mixin_for(owner, parents.get(id(owner)))
        if mixin is None:
            continue
        # A rowwise Linear's bias is added once to the summed partial outputs: it is gathered.
        ring_names = ("weight",) if id(owner) in rows or not isinstance(owner, nn.Linear) else ("weight", "bias")
        ring_slots.update((id(owner), name) for name in ring_names)
        _swap_class(owner, mixin, "Ring")
        owner._rsdp_ring = _ring_layer(state, names.get(id(owner), type(owner).__qualname__))
        if mixin is RingLinear:  # its calls go through its module's shared-input fusion
            owner._rsdp_fusion = state.fusion
        owner._rsdp_row_of = rows.get(id(owner))
        state.ring_modules.append(owner)
    for block in blocks:
        # Its forward steps run the module's code, which reads the gathered vectors a rider would bring.
        for ring_block in block.stages if isinstance(block, ExpertRing) else (block,):
            name = ring_block.name or type(block.module).__qualname__
            ring_block.ring = _ring_layer(state, name, carries_collectives=False)
        # The module the model calls: an experts module's outermost LoRA wrapper if any (_expert_lora.py).
        call_site = block.call_site if isinstance(block, ExpertRing) else block.module
        _swap_class(call_site, RingExperts if isinstance(block, ExpertRing) else RingSubBlock, "RingSub")
        call_site._rsdp_sub_block = block
        if isinstance(block, ExpertRing):  # its parameters are its rings', and its operands' outside them
            ring_slots.update((id(block.module), name) for _, name in block.param_slots)
            block.module._rsdp_ring = block.stages[0].ring
    return ring_slots


def _install_parameters(
    state: RSDPState, slots: list, replacement: dict[int, nn.Parameter], ring_slots: set[tuple[int, str]],
    column_split: set[int], names: dict[int, str], reshard_after_forward: bool, whole: set[int], has_adapters: bool,
) -> None:
    """Put the sharded parameters in place and sort them: rotated by their module's ring, rotated op by
    op (``_operand.py``: every Shard(0) ring weight, so code outside its module's forward can use it
    too, and every other matrix), or gathered whole (vectors, and the matrices of the modules in
    ``whole``: the LoRA adapters of planned sub-blocks, a router beside experts)."""
    gathered_params: list[nn.Parameter] = []
    gathered_index: dict[int, int] = {}
    gathered_slots = []
    operand_slots: list[tuple[nn.Module, str, RingLayer]] = []
    operand_layers: dict[int, RingLayer] = {}
    for owner, name, param in slots:
        sharded = replacement[id(param)]
        owner._parameters[name] = sharded
        if (id(owner), name) in ring_slots:
            if id(param) not in column_split:
                operand_slots.append((owner, name, owner._rsdp_ring))
            continue
        if sharded.dim() >= 2 and id(owner) not in whole:
            if id(sharded) not in operand_layers:
                operand_layers[id(sharded)] = _ring_layer(state, f"{names.get(id(owner))}.{name}")
            operand_slots.append((owner, name, operand_layers[id(sharded)]))
            continue
        if id(sharded) not in gathered_index:
            gathered_index[id(sharded)] = len(gathered_params)
            gathered_params.append(sharded)
        gathered_slots.append((owner, name, gathered_index[id(sharded)]))
    _check_one_dtype(gathered_params, has_adapters)
    state.set_gathered(gathered_params, gathered_slots, reshard_after_forward)
    state.operand_slots = operand_slots


class RSDPModule:
    """Mixed into every module passed to :func:`rsdp_shard` (a class swap, like FSDP2's FSDPModule)."""

    # Read by transformers (``is_fsdp_managed_module``, which transformers' own FSDP2 setup marks the same
    # way): ``generate()`` on several ranks then keeps every rank running forwards until all ranks'
    # sequences are done (``synced_gpus``), since every forward is a collective.
    _is_fsdp_managed_module = True

    def __new__(cls, *args, **kwargs):
        # Containers such as nn.Sequential build new instances of their own class when sliced; those
        # must be plain modules, not rsdp ones without rsdp state.
        orig_cls = cls._rsdp_orig_cls
        instance = orig_cls.__new__(orig_cls, *args, **kwargs)
        instance.__init__(*args, **kwargs)
        return instance

    def __deepcopy__(self, memo):
        # FSDP2 refuses too ("FSDP does not support deepcopy"): a copy would share this module's ring
        # tags, process group and hooks' state while holding other parameters.
        raise TypeError(
            f"rsdp: copy.deepcopy of an rsdp module ({type(self).__qualname__}) is not supported, as with FSDP2's "
            "fully_shard: its state (ring, process group, hooks) cannot be copied. Deep-copy the model before "
            "rsdp_shard (for a reference or EMA copy), or build and shard a second model the same way and load "
            "this one's weights: `other.load_state_dict(model.state_dict())`."
        )

    def __call__(self, *args, **kwargs):
        state = self._get_rsdp_state()
        depth = state.forward_depth
        try:
            return super().__call__(*args, **kwargs)
        except BaseException:
            # A forward that raises skips the post-forward hook. Non-reentrant activation
            # checkpointing does so on purpose (it stops recomputation early), so the sharded
            # parameters must be put back here.
            state.close_raised_forward(depth)
            raise

    def _get_rsdp_state(self) -> RSDPState:
        state = get_module_state(self)
        if not isinstance(state, RSDPState):
            raise AssertionError(f"No rsdp state on {type(self).__qualname__}")
        return state

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradient by ``factor`` instead of the number of data-parallel ranks
        (``1.0`` keeps the sum, for trainers that normalise the loss themselves, like torchtitan)."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor}")
        self._get_rsdp_state().gradients.divide_factor = factor

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Skip (``False``) or resume gradient reduction, e.g. for all but the last micro-batch.

        While off, each rank accumulates its own contribution to every shard of every parameter
        locally, so this costs one full-size (unsharded) gradient per parameter in ``reduce_dtype``,
        as FSDP2's does; the next synchronised backward reduces it together with its own gradients,
        and ``.grad`` is left untouched until then. With ``recurse``, applies to every rsdp and FSDP2
        module in the subtree.
        """
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, RSDPModule):
                module._get_rsdp_state().gradients.requires_sync = requires_gradient_sync
            elif isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(requires_gradient_sync, recurse=False)


def register_rsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run rsdp's forward hooks around ``module.<method_name>()`` (FSDP2's ``register_fsdp_forward_method``).

    rsdp gathers a module's non-rotating parameters in hooks that ``module(...)`` runs. A method called
    directly (``model.encode(x)``, ``model.generate_step(x)``, ``module.forward(x)``) skips them and
    meets the sharded DTensors ("got mixed torch.Tensor and DTensor"). Register such a method once, after
    ``rsdp_shard``; registering ``"forward"`` makes direct ``module.forward(x)`` calls work, and
    ``module(x)`` still runs the hooks once.
    """
    if not isinstance(module, RSDPModule):
        raise ValueError(
            f"register_rsdp_forward_method: {type(module).__qualname__} is not an rsdp module; call it on the "
            "module you passed to rsdp_shard."
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_rsdp_forward_method: {type(module).__qualname__} has no method {method_name!r}")
    state = module._get_rsdp_state()

    @functools.wraps(method)
    def with_rsdp_hooks(*args, **kwargs):
        if state.forward_depth > 0:  # already inside the module's forward, e.g. __call__ -> forward
            return method(*args, **kwargs)
        args, kwargs = state._pre_forward(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            state.close_raised_forward(0)
            raise
        return state._post_forward(module, args, output)

    setattr(module, method_name, with_rsdp_hooks)


def _validated_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "rsdp_shard needs an initialised default process group: call "
            "torch.distributed.init_process_group() first (torchrun sets the rendezvous variables)."
        )
    if mesh is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"rsdp_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim > 2:
        raise ValueError(
            f"rsdp_shard: mesh has {mesh.ndim} dimensions; use a 1-D (shard) or 2-D (replicate x shard) "
            "mesh, e.g. mesh['dp_replicate', 'dp_shard'] sliced from a larger one."
        )
    return mesh


def _check_ring_group_size(size, mesh: DeviceMesh) -> None:
    """A ring of groups needs g to divide W; the same arguments on every rank raise alike there."""
    world = mesh.size(mesh.ndim - 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(
            f"rsdp_shard: ring_group_size={size!r} must be a positive integer dividing the shard dimension's "
            f"size {world} (the ranks form {world}/g groups), e.g. ring_group_size=1."
        )


def _check_not_managed(module: nn.Module) -> None:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"rsdp_shard: {type(module).__qualname__} has no forward of its own; shard each of its "
            "modules instead, or the module that calls them."
        )
    state = get_module_state(module)
    if isinstance(state, RSDPState):
        raise ValueError(
            f"rsdp_shard was already applied to this {type(module).__qualname__}; apply it once per module."
        )
    if state is not None:
        raise ValueError(
            f"rsdp_shard: this {type(module).__qualname__} is already managed by {type(state).__name__} "
            "(fully_shard or replicate); apply one strategy per module."
        )


def _managed_and_nested_modules(root: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``root`` and the submodules this call manages, and the roots of the subtrees it leaves to
    other parallelism calls (nested rsdp_shard, fully_shard or replicate)."""
    managed, nested, visited = [], [], set()
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in visited:
            continue
        visited.add(id(module))
        if module is not root and get_module_state(module) is not None:
            nested.append(module)
            continue
        managed.append(module)
        stack.extend(reversed(list(module.children())))
    return managed, nested


def _sharded(param: nn.Parameter, mesh: DeviceMesh, device: torch.device, owner: nn.Module, name: str, dim: int) -> nn.Parameter:
    where = f"{type(owner).__qualname__}.{name}"
    if isinstance(param, DTensor):
        if param.device_mesh != mesh:
            raise ValueError(
                f"rsdp_shard: parameter {where} is already a DTensor on another mesh "
                f"({param.device_mesh}); rsdp_shard shards plain parameters. Apply rsdp_shard before "
                "other parallelisms, or shard this module with the mesh its parameters live on."
            )
        # rsdp_shard's (and fully_shard's) own layout, or rsdp's mark: a data-parallel call came first.
        if getattr(param, "_rsdp_sharded", False) or tuple(param.placements) == placements_for(mesh):
            raise ValueError(
                f"rsdp_shard: parameter {where} was already sharded on this mesh by an rsdp_shard (or "
                "fully_shard) call on another module: either on a module that encloses this one, or on "
                "another module that shares this submodule. Apply them bottom-up, as with fully_shard: each "
                "block first, then the root; and shard a submodule that two modules share once, with its own "
                "rsdp_shard call before either of them."
            )
        raise ValueError(
            f"rsdp_shard: parameter {where} is already a DTensor ({param.placements}); rsdp_shard "
            "shards plain parameters and does not compose with tensor parallelism on the same module."
        )
    if param in replaced:
        return replaced[param]
    if param.dim() == 0:
        raise ValueError(
            f"rsdp_shard: parameter {where} is 0-dimensional and cannot be sharded by rows; "
            "give it shape (1,) instead."
        )
    sharded = shard_parameter(param, mesh, device, dim)
    sharded._rsdp_sharded = True  # for the error above: a later call on an enclosing or sharing module
    return sharded


def _check_one_dtype(params: list[nn.Parameter], has_planned_adapters: bool) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        # A planned sub-block's LoRA adapters are gathered with the norms; peft keeps them in float32 on a
        # bf16 or fp16 model by default.
        lora = (
            " LoRA adapters on planned Linears are gathered with the module's norms: keep them in the model's dtype "
            "(peft.get_peft_model(..., autocast_adapter_dtype=False))." if has_planned_adapters else ""
        )
        raise ValueError(
            f"rsdp_shard: the gathered parameters of one module must share a dtype, found {sorted(map(str, dtypes))}; "
            f"cast the module (module.to(dtype)) or shard the odd submodule with its own rsdp_shard call.{lora}"
        )


def _swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Make ``module`` an instance of ``mixin`` + its class, named like its class.

    The swapped class keeps the original ``__name__``: code outside rsdp reads a model's class name as
    its identity (Hugging Face writes ``config.architectures`` from it, and only strips FSDP's prefix;
    vLLM and TGI dispatch on that field; ``generate`` and peft look at it too). The prefix lives in
    ``__qualname__``, which the module's repr and rsdp's own messages show.
    """
    cls = type(module)
    key = (mixin, cls)
    swapped = _swapped_classes.get(key)
    if swapped is None:
        namespace = {"_rsdp_orig_cls": cls, "__qualname__": f"{prefix}{cls.__qualname__}", "_get_name": _qualified_name}
        swapped = type(cls.__name__, (mixin, cls), namespace)
        _swapped_classes[key] = swapped
    module.__class__ = swapped


def _qualified_name(module: nn.Module) -> str:
    """``nn.Module``'s name in its repr: the swapped class's prefixed name (``RSDPLlamaForCausalLM``)."""
    return type(module).__qualname__


_swapped_classes: dict[tuple[type, type], type] = {}


def ring_mixin_for(module: nn.Module, parent: nn.Module | None) -> type | None:
    """The ring class for ``module`` if it is a Linear or Embedding whose forward is the stock one and
    whose weight is only used through that forward."""
    if isinstance(parent, nn.MultiheadAttention):
        return None  # it passes out_proj.weight to F.multi_head_attention_forward itself
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return RingLinear
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        unsupported = [
            option
            for option, value in (
                ("max_norm", module.max_norm is not None),
                ("scale_grad_by_freq", module.scale_grad_by_freq),
                ("sparse", module.sparse),
            )
            if value
        ]
        if unsupported:
            raise ValueError(
                f"rsdp_shard: nn.Embedding with {', '.join(unsupported)} cannot rotate on the ring "
                "(these options need the whole table or global index counts). Drop the option, or "
                "shard this embedding with torch's fully_shard instead."
            )
        return RingEmbedding
    return None
