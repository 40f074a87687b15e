"""Per-module strategies: replicate, FSDP or RSDP for each module, by hand or from a planner's Plan.

Replication is the fastest and heaviest (full parameters, gradients and optimizer state on every rank),
RSDP the lightest and the one with the most messages, FSDP sits between. ``parallelize`` applies a
choice per module with the project's ``rsdp_shard``, torch's ``fully_shard`` and torch's ``replicate``,
bottom-up, the way one would call them by hand.

On a 2-D mesh ``(replicate, shard)`` every strategy is group sharding (OSDP's intra-group sharding
with inter-group all-reduce, FSDP2's HSDP): FSDP and RSDP shard within the shard dimension and
all-reduce across the replicate dimension; REPLICATE all-reduces across the whole mesh.
"""

import enum
import fnmatch
from collections.abc import Mapping

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._compat import (
    WRAPPER_NAME_SEGMENTS,
    MixedPrecisionPolicy,
    flatten_mesh,
    fully_shard,
    get_module_state,
    replicate,
    share_fsdp_contexts,
    unwrap_activation_checkpoint,
)
from ._fully_shard import RSDPModule, rsdp_shard
from ._fully_shard._context import share_ring_context
from ._fully_shard._state import rsdp_states_under


class Strategy(str, enum.Enum):
    REPLICATE = "replicate"
    FSDP = "fsdp"
    RSDP = "rsdp"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value.lower() in cls._value2member_map_:
            return cls(value.lower())
        raise ValueError(
            f"{value!r} is not a strategy; use one of {[s.value for s in cls]} (Strategy.REPLICATE, "
            "Strategy.FSDP for torch's fully_shard, Strategy.RSDP for rsdp_shard)."
        )


RuleKey = str | type[nn.Module]


def parallelize(
    model: nn.Module,
    policy: Mapping[RuleKey, Strategy | str] | object,
    *,
    default: Strategy | str = Strategy.RSDP,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    ring_group_size: int = 1,
) -> nn.Module:
    """Apply a strategy to each module ``policy`` names, and ``default`` to the root.

    Args:
        model: the model; every rank builds the same one.
        policy: rules mapping module names or module types to a :class:`Strategy` (or its value:
            ``"rsdp"``, ``"fsdp"``, ``"replicate"``), or a planner ``Plan``. Names are dotted paths as
            in ``named_modules()`` before activation checkpointing or ``torch.compile`` wrapped any module
            (``layers.0.attn``, not ``layers.0._checkpoint_wrapped_module.attn``); in a pattern ``*`` stands for one path segment and ``**`` for any
            number (``"layers.*"`` matches ``layers.0`` but not ``layers.0.attn``). The root is named
            ``""``. Name rules win over type rules; among name rules, the first listed wins. Each matched
            module becomes one unit, sharded with its strategy; whatever no unit covers belongs to the
            root.
        default: the root's strategy when no rule names ``""``.
        mesh: 1-D, or 2-D ``(replicate, shard)`` for group sharding. ``None``: 1-D over the default
            process group.
        mp_policy: mixed precision for every unit.
        ring_group_size: every rsdp unit's ring of groups (``rsdp_shard``'s ``ring_group_size``): g
            dividing the shard dimension's size; 1, a ring of ranks. A ``Plan`` gives each module's
            own (``Plan.ring_group_sizes``) and refuses this one.

    Returns:
        ``model``, parallelized.
    """
    rules = policy.strategies if hasattr(policy, "strategies") else policy
    ring_group_sizes = getattr(policy, "ring_group_sizes", {})  # a Plan's, per module name
    if hasattr(policy, "ring_group_sizes") and ring_group_size != 1:
        raise ValueError(
            f"parallelize: a Plan chooses each rsdp module's ring group size, and ring_group_size={ring_group_size} "
            f"would override it; pass one of them (plan with --ring-group-sizes {ring_group_size} to make the plan's "
            f"rings groups of {ring_group_size})"
        )
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"parallelize: policy must map module names or types to strategies (or be a Plan), got "
            f"{type(policy).__name__}"
        )
    mesh = mesh or _default_mesh()
    units = _units(model, {key: Strategy(value) for key, value in rules.items()}, Strategy(default))
    _check_ties(model, units)
    group_of = _ring_group_sizes(model, units, ring_group_sizes)
    names = dict((module, name) for name, module in model.named_modules())
    for module, strategy in sorted(units.items(), key=lambda item: -_depth(names[item[0]])):
        _apply(module, strategy, mesh, mp_policy or MixedPrecisionPolicy(), is_root=module is model,
               ring_group_size=group_of.get(module, ring_group_size))
    if units[model] is not Strategy.FSDP:
        # Under an rsdp or replicate root every FSDP unit would be an FSDP root of its own (see
        # share_fsdp_contexts): make them one tree, as an FSDP root does.
        share_fsdp_contexts(
            [_state_of(module) for module, strategy in units.items() if strategy is not Strategy.RSDP]
        )
    if units[model] is not Strategy.RSDP:
        # An rsdp root's rsdp_shard gives the model's rsdp units one RingContext; under another root
        # they share one too, so that one backward's rings prefetch and carry each other's data.
        share_ring_context(rsdp_states_under(model))
    return model


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs an initialised default process group: call init_process_group() first.")
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _depth(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def name_matches(pattern: str, name: str) -> bool:
    """Dotted-path glob: ``*`` matches one segment, ``**`` any number of segments (including none)."""

    def match(pattern_parts: list[str], name_parts: list[str]) -> bool:
        if not pattern_parts:
            return not name_parts
        head, rest = pattern_parts[0], pattern_parts[1:]
        if head == "**":
            return any(match(rest, name_parts[i:]) for i in range(len(name_parts) + 1))
        return bool(name_parts) and fnmatch.fnmatchcase(name_parts[0], head) and match(rest, name_parts[1:])

    return match(pattern.split(".") if pattern else [], name.split(".") if name else [])


def _units(model: nn.Module, rules: dict[RuleKey, Strategy], default: Strategy) -> dict[nn.Module, Strategy]:
    name_rules = [(key, strategy) for key, strategy in rules.items() if isinstance(key, str)]
    type_rules = [(key, strategy) for key, strategy in rules.items() if isinstance(key, type)]
    bad_keys = [key for key in rules if not isinstance(key, (str, type))]
    if bad_keys:
        raise TypeError(f"parallelize: rule keys must be module names or module types, got {bad_keys}")

    units: dict[nn.Module, Strategy] = {model: default}
    used: set[RuleKey] = set()
    for name, module in untouched_named_modules(model):
        matching = [(key, s) for key, s in name_rules if name_matches(key, name)]
        matching += [(key, s) for key, s in type_rules if isinstance(module, key)]
        # A rule that matches only modules an earlier rule took is overridden, not unused.
        used.update(key for key, _ in matching)
        if not matching:
            continue
        key, strategy = matching[0]
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            if isinstance(key, str):
                raise ValueError(
                    f"parallelize: rule {key!r} matches {name!r}, a {type(module).__name__} with no forward "
                    f"of its own; name its modules instead, e.g. '{name}.*'."
                )
            continue
        units[module] = strategy
    unused = [key for key in rules if key not in used]
    if unused:
        names = [name for name, _ in untouched_named_modules(model) if name][:12]
        raise ValueError(
            f"parallelize: rules {unused} match no module of {type(model).__name__}; module names look "
            f"like {names}."
        )
    return units


def untouched_named_modules(model: nn.Module):
    """``named_modules()`` under the names the model had before activation checkpointing or
    ``torch.compile`` wrapped its modules: a wrapper takes its module's name (``layers.0``), and what
    the wrapped module holds keeps its own (``layers.0.attention``, not
    ``layers.0._checkpoint_wrapped_module.attention``); the wrapped module itself is left out, so a rule
    matches the wrapper, which is what the model calls."""
    seen: set[str] = set()
    for name, module in model.named_modules():
        untouched = ".".join(part for part in name.split(".") if part not in WRAPPER_NAME_SEGMENTS)
        if untouched not in seen:
            seen.add(untouched)
            yield untouched, module


def _check_ties(model: nn.Module, units: dict[nn.Module, Strategy]) -> None:
    """A parameter shared by two units works only if both rotate it (rsdp); FSDP and replicate each
    need it inside one unit."""
    unit_of: dict[nn.Module, nn.Module] = {}

    def assign(module: nn.Module, enclosing: nn.Module) -> None:
        if module not in unit_of:
            unit_of[module] = module if module in units else enclosing
            for child in module.children():
                assign(child, unit_of[module])

    assign(model, model)
    first_seen: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            where, unit = f"{name}.{param_name}".lstrip("."), unit_of[module]
            first_where, first_unit = first_seen.setdefault(id(param), (where, unit))
            both_rsdp = units[unit] is Strategy.RSDP and units[first_unit] is Strategy.RSDP
            if unit is not first_unit and not both_rsdp:
                raise ValueError(
                    f"parallelize: parameter {first_where} is tied to {where} across two units "
                    f"({units[first_unit].value} and {units[unit].value}); tied parameters must stay in one "
                    "unit (leave both modules to their common parent) unless both units are rsdp."
                )


def _ring_group_sizes(model: nn.Module, units: dict[nn.Module, Strategy], sizes: Mapping[str, int]) -> dict[nn.Module, int]:
    """Each unit's ring group size from a Plan's (module name -> g): only an rsdp unit's ring has groups."""
    by_name = dict(untouched_named_modules(model))
    group_of = {}
    for name, size in sizes.items():
        if size == 1:
            continue
        module = by_name.get(name)
        if module not in units or units[module] is not Strategy.RSDP:
            raise ValueError(
                f"parallelize: the plan gives {name or '(root)'!r} ring group size {size}, but it is not an rsdp unit "
                f"of this model; only an rsdp module's ring has groups: plan this model again."
            )
        group_of[module] = size
    return group_of


def _state_of(module: nn.Module):
    return get_module_state(module) or get_module_state(unwrap_activation_checkpoint(module))


def _apply(module: nn.Module, strategy: Strategy, mesh: DeviceMesh, mp_policy, *, is_root: bool, ring_group_size: int) -> None:
    if strategy is Strategy.RSDP:
        rsdp_shard(module, mesh=mesh, mp_policy=mp_policy, ring_group_size=ring_group_size)
    elif strategy is Strategy.FSDP:
        # A non-root FSDP unit under an rsdp or replicate parent becomes an FSDP root of its own, and
        # FSDP roots keep their parameters unsharded after forward unless told otherwise.
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, **({} if is_root else {"reshard_after_forward": True}))
    else:
        if replicate is None:
            raise RuntimeError("Strategy.REPLICATE needs torch >= 2.9 (FSDP-based replicate).")
        # torch's replicate does not recognise rsdp modules as managed; leave their parameters alone.
        nested_rsdp = {
            param
            for sub in module.modules()
            if sub is not module and isinstance(sub, RSDPModule)
            for param in sub.parameters()
        }
        replicate(module, mesh=flatten_mesh(mesh), mp_policy=mp_policy, ignored_params=nested_rsdp or None)
    if _state_of(module) is None:
        raise AssertionError(f"{strategy.value} left {type(module).__name__} unmanaged")
