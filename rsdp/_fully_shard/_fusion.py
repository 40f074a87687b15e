"""Linears that consume the same input share one ring, found automatically on the first forward.

q/k/v projections (and gate/up, and a LoRA layer's base and ``lora_A``) are called one after another
on one tensor. Rotating them separately costs one ring each; rotating their shards as one message costs
one ring for all, with the same bytes. Users change nothing:

1. **Recording** (the first forward of the rsdp module): every ring Linear runs alone, and the calls
   are noted with their input tensor.
2. At the end of that forward the Linears called exactly once on one shared input (with one weight
   dtype) become a group, in call order. Ranks compare their groups with one all-reduce, once, and
   fuse only if they all agree (NCCL needs every rank to issue the same rings in the same order).
3. The groups take effect at the next forward that is not run inside a backward and that no
   recomputation of an unfused forward can still follow: activation checkpointing recomputes a
   forward in backward, and the recomputation must save exactly what the original saved (unfused).
   So while a checkpointed forward that ran unfused (under grad, inside ``saved_tensors_hooks``) has
   not had its backward, forwards stay unfused: a ``no_grad`` forward of the same model between a
   forward and its backward (TRL's SFT metrics, DPO's reference) must not switch the recomputation.
4. From then on, when a group's first member is called, one ring computes every member's output; the
   others, called later with the *same* tensor, take theirs. A member called with another tensor (the
   pattern changed) runs its own ring: always correct, if slower; outputs not taken are dropped at the
   end of the module's forward.

Pitfalls:
- A fused group's backward returns zero, not None, gradients for a member whose output was not
used (autograd materialises the missing output gradient); stock Linears would return None.
- The switch waits for the backward of this module that follows the unfused checkpointed forwards;
  two such forwards whose backwards come apart, with a forward between them, would still see it
  (torch's ``CheckpointError``: loud, never a wrong number).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from .._compat import in_backward, saved_tensors_hooks_active
from ._linear import run_linear_group
from ._ring_function import RingLayer


class SharedInputFusion:
    """The fusion state of one rsdp module (one ``RSDPState``)."""

    def __init__(self, state):
        self.state = state
        self.recording = True
        self._calls: list[tuple[nn.Module, torch.Tensor]] = []
        self._group_of: dict[int, tuple[RingLayer, list[nn.Module]]] = {}
        self._formed: dict[int, tuple[RingLayer, list[nn.Module]]] = {}
        self._taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._raised = False
        # A checkpointed forward ran before the groups took effect and its backward has not run yet:
        # its recomputation must run unfused too.
        self._unfused_recomputation_pending = False

    def linear(self, module: nn.Module, input: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self._calls.append((module, input))
        elif self._formed and not in_backward() and not self._unfused_recomputation_pending:
            self._group_of, self._formed = self._formed, {}
        if (self.recording or self._formed) and torch.is_grad_enabled() and saved_tensors_hooks_active() and not in_backward():
            # Checked here, not at the module's forward hooks: a checkpoint may wrap the forward alone
            # (Hugging Face's layers), and the recomputation runs it without the hooks.
            self._unfused_recomputation_pending = True
        found = self._group_of.get(id(module))
        if found is None:
            return run_linear_group(module._rsdp_ring, [module], input)[0]
        group_layer, members = found
        if module is members[0]:
            outputs = run_linear_group(group_layer, members, input)
            for member, output in zip(members[1:], outputs[1:]):
                self._taken[id(member)] = (input, output)
            return outputs[0]
        waiting = self._taken.pop(id(module), None)
        if waiting is not None and waiting[0] is input:
            return waiting[1]
        return run_linear_group(module._rsdp_ring, [module], input)[0]

    def forward_raised(self) -> None:
        """The module's forward raised, perhaps on this rank only (an input that fails rsdp's checks):
        its end must not form the groups, whose all-reduce the peers, waiting in a ring, would not join
        (and the error would become a timeout). The next forward records again."""
        self._raised = True

    def end_forward(self) -> None:
        """Called when the rsdp module's forward ends (or raises): drop untaken outputs, and after the
        first forward, form the groups."""
        self._taken.clear()
        if self._raised:
            self._raised = False
            self._calls.clear()
            return
        if self.recording:
            self.recording = False
            calls, self._calls = self._calls, []
            self._form_groups(calls)

    def backward_ended(self) -> None:
        """The module's backward ran: the unfused forwards before it have been recomputed."""
        self._unfused_recomputation_pending = False

    def _form_groups(self, calls: list[tuple[nn.Module, torch.Tensor]]) -> None:
        times_called: dict[int, int] = {}
        for module, _ in calls:
            times_called[id(module)] = times_called.get(id(module), 0) + 1
        groups: list[list[nn.Module]] = []
        for module, input in calls:
            if times_called[id(module)] != 1:
                continue
            for group in groups:
                if group[0][1] is input and group[0][0].weight.dtype == module.weight.dtype:
                    group.append((module, input))
                    break
            else:
                groups.append([(module, input)])
        groups = [[module for module, _ in group] for group in groups if len(group) > 1]
        if not any(isinstance(module, nn.Linear) for module in self.state.ring_modules):
            return  # the same on every rank: nothing to agree on
        if not self._all_ranks_agree(groups):
            return
        for members in groups:
            leader = members[0]._rsdp_ring
            name = "+".join(member._rsdp_ring.name for member in members)
            group_layer = leader.sharing(name)
            for member in members:
                self._formed[id(member)] = (group_layer, members)
        if groups:  # the next pass runs other rings: this one says nothing about its order
            self.state.ring.context.schedules[False].forget_this_pass()

    def _all_ranks_agree(self, groups: list[list[nn.Module]]) -> bool:
        """One all-reduce (max and -min at once) over every rank of the mesh, once per module."""
        position = {id(module): index for index, module in enumerate(self.state.ring_modules)}
        leader_of = torch.full((len(position),), -1, dtype=torch.int64)
        for members in groups:
            for member in members:
                leader_of[position[id(member)]] = position[id(members[0])]
        both = torch.cat([leader_of, -leader_of]).to(self.state.device)
        for dim in range(self.state.mesh.ndim):
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.state.mesh.get_group(dim))
        highest, negated_lowest = both.cpu().chunk(2)
        return torch.equal(highest, -negated_lowest)
