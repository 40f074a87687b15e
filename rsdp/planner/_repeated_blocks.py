"""Counting a stack of transformer blocks by a few of each kind.

A decoder's blocks (``layers.0`` .. ``layers.N-1``) are usually copies of one block, or of a few kinds
of block (sliding and full attention alternating, dense layers before experts ones). Blocks of one
kind have the same modules, parameter shapes and dtypes, the same activation-checkpoint wrapper and
policy, so they run the same ops on same-shaped inputs, and each one's phases (what its forward and
backward allocate and free above their start, its FLOPs and work, its parameter counts) are the same;
so are the phases around the stack. The meta-device count (``_cost_model.count``) then runs the model
with the stack cut to a prefix that holds two middle blocks of every kind (``kept_prefix``) and the
last block, checks that each kind's two came out identical, and gives every left-out block its kind's
first middle block's counts; the caching allocator replays the whole stack's events, the left-out
blocks' copied from that block's (``RepeatedBlocks.whole_step_events``). The first and the last block are counted themselves: the first's input
and the last's output meet the root's work (embedding, head). When a check fails the model is counted
whole, so the result is the full count to the byte (``tests/test_planner.py`` pins it, on published
Hugging Face configs too).

Blocks are of one kind when their fingerprints are equal: every submodule's type, every parameter's
and buffer's shape, dtype and ``requires_grad``, and every attribute (numbers, strings, configs, and
the functions and closures of wrappers such as torchtitan's per-op checkpoint policy, compared by code
and captured values; a library's plain object, such as torchtitan's MoE token dispatcher, by its type
and attributes; any other object (torch's own: operators, with their dispatch caches) by identity; not
what only initialisation reads, nor transformers' ``layer_idx``, which addresses the KV cache). A
block's layer type, sliding window, or dense MLP in place of experts makes it another kind.

Pitfalls:
- The cut stack keeps its blocks' names (``layers.31`` stays ``layers.31``): the model's own stack has
  its ``_modules`` cut while the count copies it (only the kept blocks are copied), and restored. A model whose forward indexes its stack by
  position (``self.layers[i] for i in range(n)``) cannot run cut; it raises, and is counted whole.
- A forward that treats blocks differently by their position in its loop (``enumerate``) rather than
  by their own attributes sees the cut stack's positions: the prefix keeps its own, and the last block
  is placed where a block of its kind ran (transformers' gpt-oss picks each layer's attention mask by
  ``config.layer_types[i]``). Work that follows a position or ``layer_idx`` beyond what the block
  stores (transformers' looped ``dory`` reads a cache keyed by ``layer_idx``) would be counted as if
  every left-out block were its kind's first; stock decoders decide per block from its attributes,
  which the fingerprint covers.
"""

import collections
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
# transformers' per-layer index: every attention module and most decoder layers keep their ``layer_idx``,
# with which their forward addresses the KV cache (not there in a training step: ``use_cache`` off)
# and which nothing else in a stock decoder reads to decide what to compute. What a layer's index does
# decide (its layer type, a sliding window, dense or experts) its ``__init__`` stores as attributes or
# submodules, which the fingerprint covers.
_CACHE_INDICES = frozenset({"layer_idx"})


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
            {key: value for key, value in vars(module).items() if key not in _MODULE_INTERNALS | _NOT_RUN | _CACHE_INDICES}
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
    """A stack whose blocks are all units and fall into kinds of alike blocks: the counted step keeps
    ``kept`` of them, and each block it leaves out takes the counts of its kind's first middle block."""

    stack: nn.Module
    names: list[str]  # every block's unit name, in order
    kept: list[str]  # the blocks the cut step runs: a prefix of the stack and the last block
    represented_by: dict[str, str]  # a left-out block's name: its kind's first middle block's
    compared: list[tuple[str, str]]  # each such kind's first two middle blocks, whose counts must be equal

    def representative(self, name: str) -> str:
        """The unit whose counts ``name``'s are: its kind's first middle block for a block the cut step
        left out, else itself."""
        return self.represented_by.get(name, name)

    def whole_step_events(self, events: list[tuple]) -> list[tuple]:
        """The caching allocator's events (``("malloc", key, bytes)``, ``("free", key)``, ``("mark",
        label)``) of the whole stack's step, from the cut step's: each left-out block's segments (from
        its ``forward:``/``backward:`` mark to the next mark, and from its ``-done`` mark on) are its
        representative's, inserted where the whole step runs them. A free of a storage another block
        allocated (its input, its output's gradient) frees the one the block as far from this one
        allocated, the same number of allocations before the end of that block's segment; a storage of
        another size there raises (the count is then made whole). A storage of a left-out block that
        only the root's work would free is never freed (none in the stacks ``tests/test_planner.py``
        pins, whose replays equal the whole step's)."""
        labels, segments = [None], [[]]  # cut step: the events before the first mark, then after each
        allocations = [0]  # each segment's number of allocations
        live, sizes = {}, {}  # key -> (segment, allocation index); allocation -> bytes
        for event in events:
            if event[0] == "mark":
                labels.append(event[1])
                segments.append([])
                allocations.append(0)
                continue
            if event[0] == "malloc":
                if event[1] in live:  # a storage replaced under the same key
                    segments[-1].append(("free", live[event[1]]))
                allocation = (len(segments) - 1, allocations[-1])
                allocations[-1] += 1
                live[event[1]], sizes[allocation] = allocation, event[2]
                segments[-1].append(("malloc", allocation))
            elif event[1] in live:
                segments[-1].append(("free", live.pop(event[1])))
        index_of = {label: index for index, label in enumerate(labels)}
        position = {name: index for index, name in enumerate(self.names)}
        cut_position = {name: index for index, name in enumerate(self.kept)}

        def block_of(label):
            kind, _, name = (label or "").partition(":")
            return (kind, name) if name in position else (None, None)

        # The whole step's segments: (its label, the cut segment it copies, its block's name or None).
        order = []
        left_out = [name for name in self.names if name not in cut_position]
        for label in labels:
            order.append((label, index_of[label], block_of(label)[1]))
            kind, name = block_of(label)
            if (kind, name) == ("forward-done", self.kept[-2]):
                order += [(f"{k}:{block}", index_of[f"{k}:{self.represented_by[block]}"], block)
                          for block in left_out for k in ("forward", "forward-done")]
            elif (kind, name) == ("backward-done", self.kept[-1]):
                order += [(f"{k}:{block}", index_of[f"{k}:{self.represented_by[block]}"], block)
                          for block in reversed(left_out) for k in ("backward", "backward-done")]
        whole_index = {label: index for index, (label, _, _) in enumerate(order)}

        def whole_allocation(allocation, block):
            """The whole step's allocation that a free in ``block``'s copied segment refers to."""
            segment, number = allocation
            kind, owner = block_of(labels[segment])
            if owner is None or block is None:
                return whole_index[labels[segment]], number
            source = self.represented_by.get(block, block)  # the kept block whose segment this is
            target = position[block] + cut_position[owner] - cut_position[source]
            if not 0 <= target < len(self.names):
                raise ValueError("a block's free refers past the stack")
            target_segment = whole_index[f"{kind}:{self.names[target]}"]
            target_source = order[target_segment][1]
            target_number = allocations[target_source] - (allocations[segment] - number)
            if target_number < 0 or sizes.get((target_source, target_number)) != sizes[allocation]:
                raise ValueError("blocks allocate differently")
            return target_segment, target_number

        whole = []
        for index, (label, source, block) in enumerate(order):
            if label is not None:
                whole.append(("mark", label))
            for action, allocation in segments[source]:
                if action == "malloc":
                    whole.append(("malloc", (index, allocation[1]), sizes[allocation]))
                else:
                    whole.append(("free", whole_allocation(allocation, block)))
        return whole

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


def kept_prefix(kinds: list) -> int | None:
    """How many blocks from the start of a stack of ``kinds`` the cut step keeps (the last block joins
    them), or None where keeping them saves nothing.

    The prefix holds every kind's first two middle blocks (a kind of one: it), and is extended until the block after it is of the last block's kind: in the cut stack the
    last block runs at that position, so a forward that reads per-position values by its loop index
    (transformers' ``config.layer_types[i]``, the attention mask of a layer type) hands it the values
    of a block of its own kind."""
    middle = collections.defaultdict(list)
    for index, kind in enumerate(kinds[1:-1], start=1):
        middle[kind].append(index)
    prefix = 1 + max(indices[:2][-1] for indices in middle.values())
    while prefix < len(kinds) - 1 and kinds[prefix] != kinds[-1]:
        prefix += 1
    return prefix if prefix < len(kinds) - 1 else None


def repeated_blocks(model: nn.Module, units: list[str]) -> RepeatedBlocks | None:
    """The stack worth cutting (more than four blocks, every one a unit, some left out by the cut), if
    the model has one."""
    for name, stack in model.named_modules():
        if not isinstance(stack, (nn.ModuleList, nn.ModuleDict)) or len(stack) <= KEPT_AT_START + 1:
            continue
        names = [f"{name}.{key}" if name else key for key in stack._modules]
        if not set(names) <= set(units):
            continue
        numbered: dict = {}
        kinds = tuple(numbered.setdefault(block_fingerprint(block), len(numbered)) for block in stack._modules.values())
        prefix = kept_prefix(list(kinds))
        if prefix is None:
            continue
        middle = collections.defaultdict(list)  # each kind's middle blocks in the prefix
        for index in range(1, prefix):
            middle[kinds[index]].append(names[index])
        represented_by = {block: middle[kind][0] for block, kind in zip(names[prefix:-1], kinds[prefix:-1])}
        compared = [tuple(middle[kind][:2]) for kind in dict.fromkeys(kinds[prefix:-1])]
        return RepeatedBlocks(stack, names, names[:prefix] + names[-1:], represented_by, compared)
    return None
