"""Counting a stack of identical transformer blocks by four of them.

A decoder's blocks (``layers.0`` .. ``layers.N-1``) are usually copies of one block: the same modules,
parameter shapes and dtypes, the same activation-checkpoint wrapper and policy. Such blocks run the
same ops on same-shaped inputs, so each one's phases (what its forward and backward allocate and free
above their start, its FLOPs, its parameter counts) are the same, and so are the phases around the
stack. The meta-device count (``_cost_model.count``) then runs the model with the stack cut to its
first three blocks and its last one, checks that the second and third came out identical, and gives
every middle block the second's counts. The first and the last are counted themselves: the first's
input and the last's output meet the root's work (embedding, head). When anything differs the model is
counted whole, so the result is the full count to the byte (``tests/test_planner.py`` pins it).

Blocks are alike when their fingerprints are: every submodule's type, every parameter's and buffer's
shape, dtype and ``requires_grad``, and every attribute (numbers, strings, configs, and the functions
and closures of wrappers such as torchtitan's per-op checkpoint policy, compared by code and captured
values; a library's plain object, such as torchtitan's MoE token dispatcher, by its type and
attributes; any other object (torch's own: operators, with their dispatch caches) by identity; not
what only initialisation reads). A block that differs in any of these, e.g. Hugging Face's
``layer_idx`` or a sliding-window attention type, makes the stack count whole.

Pitfalls:
- The cut stack keeps its blocks' names (``layers.31`` stays ``layers.31``): the model's own stack has
  its ``_modules`` cut while the count copies it (only the kept blocks are copied), and restored. A model whose forward indexes its stack by
  position (``self.layers[i] for i in range(n)``) cannot run cut; it raises, and is counted whole.
- A forward that treats blocks differently by their position in its loop (``enumerate``) rather than
  by their own attributes would be counted as if every middle block were the second. Decoders in
  torchtitan and transformers decide per block from the block's own attributes, which the fingerprint
  covers.
"""

import contextlib
import dataclasses
import enum
import functools
import types

import torch
import torch.nn as nn

# The blocks a cut stack keeps: the first three (the second and third are compared) and the last.
KEPT_AT_START = 3
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
# Attributes no forward or backward reads: state-dict hooks, torchtitan's per-parameter initialisers
# (``_param_init``: a std scaled by the block's depth, read by ``init_weights`` only), and the count's
# own note of the original parameters (``_cost_model.meta_copy``).
_NOT_RUN = frozenset(
    {"_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
     "_param_init", "_rsdp_original_params"}
)


def fingerprint(value, depth: int = 0):
    """A hashable description of ``value`` that is equal for two blocks' attributes iff they behave alike."""
    if depth > 8:
        return ("object", id(value))
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad)
    if isinstance(value, nn.Module):
        return ("module", type(value))  # its own fingerprint is taken where it sits in the tree
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(map(repr, value)) if isinstance(value, (set, frozenset)) else value
        return (type(value), tuple(fingerprint(item, depth + 1) for item in items))
    if isinstance(value, dict):
        return ("dict", tuple((fingerprint(k, depth + 1), fingerprint(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        return ("partial", fingerprint(value.func, depth + 1), fingerprint(value.args, depth + 1),
                fingerprint(value.keywords, depth + 1))
    if isinstance(value, types.FunctionType):
        cells = tuple(fingerprint(cell.cell_contents, depth + 1) for cell in value.__closure__ or ())
        return ("function", value.__code__, fingerprint(value.__defaults__, depth + 1), cells)
    if isinstance(value, types.MethodType):
        return ("method", fingerprint(value.__func__, depth + 1), fingerprint(value.__self__, depth + 1))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple((f.name, fingerprint(getattr(value, f.name), depth + 1)) for f in dataclasses.fields(value))
        return ("dataclass", type(value), fields)
    if hasattr(value, "__dict__") and not isinstance(value, type) and not type(value).__module__.startswith("torch."):
        return ("object", type(value), fingerprint(vars(value), depth + 1))
    return ("object", id(value))


def _hooks_by_rank(attributes: dict) -> dict:
    """``attributes`` with the hook dictionaries keyed by each handle's rank within the module rather
    than by its id, which counts up through the process (two blocks' alike hooks have different ids)."""
    hooks = {key: value for key, value in attributes.items() if key.endswith(_HOOK_SUFFIXES)}
    rank = {handle: index for index, handle in enumerate(sorted({h for table in hooks.values() for h in table}))}
    return {**attributes, **{key: {rank[h]: hook for h, hook in table.items()} for key, table in hooks.items()}}


_HOOK_SUFFIXES = ("_hooks", "_hooks_with_kwargs", "_hooks_always_called")


def block_fingerprint(block: nn.Module):
    """Every submodule's place, type, parameters, buffers and attributes (hooks included)."""
    described = []
    for name, module in block.named_modules():
        attributes = _hooks_by_rank(
            {key: value for key, value in vars(module).items() if key not in _MODULE_INTERNALS | _NOT_RUN}
        )
        described.append((
            name,
            type(module),
            tuple((n, fingerprint(p)) for n, p in module.named_parameters(recurse=False)),
            tuple((n, fingerprint(b)) for n, b in module.named_buffers(recurse=False)),
            fingerprint(attributes),
        ))
    return tuple(described)


@dataclasses.dataclass(frozen=True)
class RepeatedBlocks:
    """A stack whose blocks are all units and alike: the counted step keeps ``kept`` of them."""

    stack: nn.Module
    names: list[str]  # every block's unit name, in order
    kept: list[str]  # the blocks the cut step runs: the first three and the last

    @property
    def compared(self) -> tuple[str, str]:
        """Two middle blocks whose counts must come out equal."""
        return self.kept[1], self.kept[2]

    def representative(self, name: str) -> str:
        """The unit whose counts ``name``'s are: the second block for a block the cut step left out,
        else itself."""
        return self.kept[1] if name in self.names and name not in self.kept else name

    @contextlib.contextmanager
    def cut(self):
        """The stack with only the kept blocks, under their own names, for the duration."""
        children = self.stack._modules
        keys = [name.rsplit(".", 1)[-1] for name in self.kept]
        self.stack._modules = type(children)((key, children[key]) for key in keys)
        try:
            yield
        finally:
            self.stack._modules = children


def repeated_blocks(model: nn.Module, units: list[str]) -> RepeatedBlocks | None:
    """The stack of alike blocks worth cutting (more than four, every one a unit), if the model has one."""
    for name, stack in model.named_modules():
        if not isinstance(stack, (nn.ModuleList, nn.ModuleDict)) or len(stack) <= KEPT_AT_START + 1:
            continue
        names = [f"{name}.{key}" if name else key for key in stack._modules]
        if not set(names) <= set(units):
            continue
        blocks = list(stack._modules.values())
        first = block_fingerprint(blocks[0])
        if all(block_fingerprint(block) == first for block in blocks[1:]):
            return RepeatedBlocks(stack, names, names[:KEPT_AT_START] + names[-1:])
    return None
