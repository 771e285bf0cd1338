"""Split one chunk's backward into the input gradient (BACKWARD_INPUT) and the weight gradients (WEIGHT).

Zero-bubble schedules run the part of a backward that the previous stage waits for (the gradient of the
chunk's input) at once, and the rest (the gradients of the weights) later, in a bubble. The split works on
the autograd graph itself, so it covers every parameter the chunk has, whatever layer made it: column- and
row-parallel linears (with sequence parallelism), plain nn.Linear at tp = 1, norms, biases, the embeddings
and the tied output layer, the fused kernels (autograd.Functions), recomputed layers.

The graph nodes on a path from the output to the input form the *input closure*: the input gradient needs
exactly them. A parameter's gradient leaves that closure at the closure nodes it feeds (for a linear, the
matmul node that also produces the input gradient): these are its *intermediates*. BACKWARD_INPUT runs the
engine towards the input only (`inputs=(input,)`, keeping the graph), so a matmul node computes only its
input gradient, and a pre-hook on every intermediate records the gradient flowing into it. WEIGHT then runs
the engine once per group of parameters that share intermediates, from those intermediates with the
recorded gradients to the parameters only: exactly the weight GEMMs (and the small norm / bias
reductions). Parameters accumulate through their AccumulateGrad nodes, so the post-accumulate hooks of
parallel/data_parallel.py fire in WEIGHT, and the dp buckets become ready after the last WEIGHT.

Costs and limits, all correct but slower than ideal: an autograd.Function (the fused kernels) computes all
its gradients whenever it runs, so its node does its whole backward in both parts; a parameter used under
activation recomputation makes WEIGHT recompute its checkpointed region (once per parameter group: the
checkpoint recomputes per engine run). Everything a micro-batch saved for backward stays until its WEIGHT
(the graph is kept), which is why the schedules count a micro-batch as in flight until then. The first
virtual stage has no input gradient to send: its whole backward runs as its WEIGHT. This follows
torch.distributed.pipelining's stage_backward_input / stage_backward_weight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from compat.torch_private import autograd_engine

Grads = tuple[torch.Tensor | None, ...]


def engine_run(
    roots: Sequence[torch.Tensor] | Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    keep_graph: bool,
    accumulate: bool,
) -> tuple[torch.Tensor, ...]:
    """The autograd engine without the shape check of torch.autograd.backward/grad, which would trip on an
    output deallocated by the executor (its `.data` is a 1-element tensor; the graph is intact). Where that
    engine entry is missing the executor keeps outputs whole and the public functions do the same work."""
    engine = autograd_engine()  # private torch: compat/torch_private.AUTOGRAD_ENGINE
    if engine is None:
        if accumulate:
            torch.autograd.backward(roots, list(grads), retain_graph=keep_graph, inputs=list(inputs) or None)
            return ()
        return torch.autograd.grad(roots, list(inputs), list(grads), retain_graph=keep_graph, allow_unused=True)
    return engine.run_backward(
        tensors=tuple(roots),
        grad_tensors=tuple(grads),
        keep_graph=keep_graph,
        create_graph=False,
        inputs=tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=accumulate,
    )


@dataclass
class _Group:
    """Parameters whose gradients leave the input closure at the same intermediate nodes."""

    intermediates: list[Node]
    params: list[torch.Tensor]
    captured: dict[Node, Grads] = field(default_factory=dict)  # gradients flowing into each, recorded by B


@dataclass
class DeferredWeightGrad:
    """The weight-gradient part of one (micro-batch, chunk) backward; `run` once."""

    groups: list[_Group]
    # (output, grad, params): a backward from the output itself, for the first virtual stage (no input) and
    # for parameters whose gradient never meets the input closure
    from_output: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None = None

    def run(self) -> None:
        """Accumulate the deferred weight gradients into the parameters (post-accumulate hooks fire)."""
        if self.from_output is not None:  # first: it may pass through nodes a group run would free
            output, grad, params = self.from_output
            engine_run((output,), (grad,), params, keep_graph=bool(self.groups), accumulate=True)
        for group in self.groups:
            _run_group(group)
        self.groups, self.from_output = [], None  # release the graph


def _run_group(group: _Group) -> None:
    roots: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    for node in group.intermediates:
        for index, grad in enumerate(group.captured.get(node, ())):
            if grad is not None:
                roots.append(GradientEdge(node, index))
                grads.append(grad)
    if not roots:
        return
    handles = []
    if len(group.intermediates) > 1:
        # One intermediate may lie below another (a parameter used twice): pin each to its recorded input
        # so that what flows down from the upper one is not counted twice.
        for node in group.intermediates:
            recorded = group.captured.get(node)
            if recorded is not None:
                handles.append(node.register_prehook(lambda _grads, recorded=recorded: recorded))
    try:
        engine_run(roots, grads, group.params, keep_graph=False, accumulate=True)
    finally:
        for handle in handles:
            handle.remove()


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """For every node reachable from `root` (backward direction), the nodes that feed gradient into it."""
    consumers: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
            consumers[child].append(node)
    return consumers


def _walk_up(start: Node, consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], bool]:
    """Nodes of `stop` met walking from `start` towards the output, and whether the walk reached the output
    (a node nobody consumes) without meeting `stop` on that path."""
    seen, met, reached_top = {start}, set(), False
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if not consumers[node]:
            reached_top = True
        for parent in consumers[node]:
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return met, reached_top


def _param_groups(
    consumers: dict[Node, list[Node]], closure: set[Node], params: Sequence[torch.Tensor]
) -> tuple[list[_Group], list[torch.Tensor]]:
    """Parameters grouped by shared intermediates, and those whose gradient reaches the output around the
    closure (they need a backward from the output)."""
    group_of: dict[Node, _Group] = {}
    groups: list[_Group] = []
    around: list[torch.Tensor] = []
    for param in params:
        node = get_gradient_edge(param).node
        if node not in consumers:
            continue  # unused by this chunk's output: no gradient
        met, reached_top = _walk_up(node, consumers, closure)
        if reached_top or not met:
            around.append(param)
            continue
        joined = {id(g): g for g in (group_of[n] for n in met if n in group_of)}
        group = _Group(sorted(met, key=id), [param])
        for other in joined.values():  # merge the groups that share an intermediate with this param
            group.intermediates += [n for n in other.intermediates if n not in met]
            group.params += other.params
            groups.remove(other)
        for intermediate in group.intermediates:
            group_of[intermediate] = group
        groups.append(group)
    return groups, around


def backward_input(
    output: torch.Tensor, grad: torch.Tensor, input_tensor: torch.Tensor | None, params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, DeferredWeightGrad]:
    """The gradient of `input_tensor` (None without an input) from `output` with gradient `grad`, computing
    no weight gradient; and what computes those later. See the module docstring."""
    params = [p for p in params if p.requires_grad]
    if output.grad_fn is None:
        return None, DeferredWeightGrad([])
    if input_tensor is None or not input_tensor.requires_grad:
        return None, DeferredWeightGrad([], (output, grad, params))
    consumers = _consumers(output.grad_fn)
    input_node = get_gradient_edge(input_tensor).node
    if input_node not in consumers:  # the chunk ignored its input
        return None, DeferredWeightGrad([], (output, grad, params))
    closure = _upstream(input_node, consumers)
    groups, around = _param_groups(consumers, closure, params)
    handles = []
    for group in groups:
        for node in group.intermediates:
            handles.append(node.register_prehook(_recorder(group, node)))
    try:
        (input_grad,) = engine_run((output,), (grad,), (input_tensor,), keep_graph=True, accumulate=False)
    finally:
        for handle in handles:
            handle.remove()
    return input_grad, DeferredWeightGrad(groups, (output, grad, around) if around else None)


def _upstream(start: Node, consumers: dict[Node, list[Node]]) -> set[Node]:
    """Every node from which gradient flows into `start` (the input closure when `start` is the input)."""
    seen = {start}
    queue = deque([start])
    while queue:
        for parent in consumers[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    seen.discard(start)
    return seen


def _recorder(group: _Group, node: Node):
    def record(grads: Grads) -> None:
        group.captured[node] = tuple(grads)

    return record
