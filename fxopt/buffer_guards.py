"""Compile-time facts about module buffers, checked before every call, and what runs when one fails.

The attention pass reads some masks from module buffers at compile time (a causal `tril` buffer, ALiBi
slopes, a mask that hides nothing and is dropped) and compiles the fact, not the buffer. A later call
may pass a buffer that no longer holds it: the buffer was written in place (`load_state_dict`, `copy_`),
or it is another instance's (dynamo reuses one graph for every instance of a module class: buffers are
graph inputs, and it guards their shapes, not their values). Such a call runs the graph as dynamo
captured it, before fxopt's passes (eager ATen, unfused attention included: right for any buffer
value), and says so once per buffer in a warning.
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .analysis.torch_ops import module_attribute

_log = logging.getLogger("fxopt.attention")
_MAX_VERDICTS = 64  # (address, version) pairs remembered per buffer


@dataclass
class InputGuard:
    """A compile-time fact about the buffer at graph input `index`: its value was `snapshot`.

    `holds(tensor)` decides once per (address, version): a buffer unchanged since it was decided costs two
    integer reads. A new address or a CPU tensor is compared on the host. A GPU buffer that held the fact
    and was written in place since (DDP broadcasts module buffers before each forward) is compared on the
    device with torch._assert_async and taken as holding: reading the answer back would stall the host
    until every queued kernel finished (a 9 ms stall per buffer per step waiting for the other rank's
    all-reduce, measured on two H200s), so such a buffer written with another value stops the process
    with a device-side assertion instead of falling back."""

    index: int  # position among the graph's inputs
    name: str
    snapshot: torch.Tensor  # on the CPU
    site: str
    verdicts: dict = field(default_factory=dict)  # (data_ptr, version) -> whether the fact holds
    device_addresses: set = field(default_factory=set)  # GPU buffers seen holding the fact
    _on_device: torch.Tensor | None = None

    @classmethod
    def of(cls, index: int, name: str, tensor: torch.Tensor, site: str) -> "InputGuard":
        guard = cls(index, name, tensor.detach().cpu().clone(), site)
        if not isinstance(tensor, FakeTensor):  # the compile-time buffer itself holds the fact
            guard._remember(tensor, True)
        return guard

    def holds(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, FakeTensor):  # dynamo's DDP optimizer runs each compiled piece on fake
            return True                     # inputs to find the next piece's: nothing real is computed
        known = self.verdicts.get((tensor.data_ptr(), tensor._version))
        if known is not None:
            return known
        same_layout = tensor.shape == self.snapshot.shape
        if tensor.device.type != "cpu" and same_layout and tensor.data_ptr() in self.device_addresses:
            if self._on_device is None or self._on_device.device != tensor.device:
                self._on_device = self.snapshot.to(tensor.device)
            torch._assert_async((tensor.detach() == self._on_device).all(),
                                f"fxopt: buffer '{self.name}' was written after compilation with another value "
                                f"(attention at node '{self.site}' was compiled from its old value)")
            return self._remember(tensor, True)
        return self._remember(tensor, same_layout and torch.equal(tensor.detach().cpu(), self.snapshot))

    def _remember(self, tensor: torch.Tensor, holds: bool) -> bool:
        if len(self.verdicts) >= _MAX_VERDICTS:
            self.verdicts.clear()
        self.verdicts[(tensor.data_ptr(), tensor._version)] = holds
        if holds and tensor.device.type != "cpu":
            self.device_addresses.add(tensor.data_ptr())
        return holds


class UnspecialisedGraph:
    """A copy of a dynamo graph taken before a pass specialises it on a buffer (subgraph bodies copied
    too, tensors shared); made into a module only when a call needs it."""

    def __init__(self, gm: fx.GraphModule):
        self.graph = copy.deepcopy(gm.graph)
        self.attributes = {}
        for n in self.graph.nodes:
            if n.op in ("get_attr", "call_module"):
                value = module_attribute(gm, n.target)
                self.attributes[n.target] = UnspecialisedGraph(value) if isinstance(value, fx.GraphModule) else value
        self._module = None

    def module(self) -> fx.GraphModule:
        if self._module is None:
            attrs = {k: v.module() if isinstance(v, UnspecialisedGraph) else v for k, v in self.attributes.items()}
            self._module = fx.GraphModule(attrs, self.graph)
        return self._module


def guarded(compiled, guards: list[InputGuard], unspecialised: UnspecialisedGraph):
    """`compiled`, called when every guard holds; otherwise the unspecialised graph, eagerly."""
    warned: set[str] = set()

    @functools.wraps(compiled)
    def call(*args):
        flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args  # boxed or not
        failed = [g for g in guards if not g.holds(flat[g.index])]
        if not failed:
            return compiled(*args)
        for g in failed:
            if g.name not in warned:
                warned.add(g.name)
                _log.warning("fxopt: buffer '%s' no longer holds the value attention at node '%s' was compiled "
                             "from (written after compilation, or another instance's buffer): calls with it run "
                             "the graph unfused, in eager ATen. Fix: torch._dynamo.reset() and compile again, or "
                             "one torch.compile per instance", g.name, g.site)
        return unspecialised.module()(*flat)
    return call
