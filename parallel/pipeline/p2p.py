"""Point-to-point messages between pipeline stages, posted in an order that cannot mismatch or deadlock.

Which messages exist follows from the action lists alone: the forward of virtual stage k sends an activation
to stage k+1, the backward of stage k sends an input-gradient to stage k-1. NCCL ignores tags and matches
the messages between two ranks by order, and may serialise a pair's sends and receives on one stream where
a send waits for its receive. Schedules are pure functions, so every rank rebuilds all ranks' lists and
derives the same joint plan of batches (`plan_steps`): each batch is matched in full by the peers' batches,
and per ordered pair the receives are posted in the sender's order. See `plan_steps` for why this cannot
deadlock.

Scatter/gather (paper section 4.1): with tp > 1 and no sequence parallelism every tp rank of a stage holds
the same activation, so each sends only its 1/tp slice of the flattened tensor and the receiving stage
all-gathers the slices over its tp group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel.comm import P2P, RecordedWork
from parallel.pipeline.schedules import Action, Op, unhandled_op
from parallel.pipeline.stages import last_virtual_stage, stage_rank, virtual_stage
from parallel.state import ParallelState


@dataclass(frozen=True)
class Message:
    """One tensor sent between virtual stages: an activation (sent by a forward) or an input-gradient (sent by
    a backward)."""

    kind: Op  # FORWARD (an activation, to stage + 1) or BACKWARD (an input-gradient, to stage - 1)
    microbatch: int
    stage: int  # the receiving virtual stage


def needed_message(
    action: Action, pp_rank: int, pp_size: int, vp_size: int, v_shape: bool = False
) -> tuple[int, Message] | None:
    """(source pp rank, message) that `action` must receive first, or None (a WEIGHT needs nothing)."""
    stage = virtual_stage(pp_rank, action.chunk, pp_size, v_shape)
    match action.op:
        case Op.FORWARD:
            if stage == 0:
                return None
            return stage_rank(stage - 1, pp_size, v_shape), Message(Op.FORWARD, action.microbatch, stage)
        case Op.BACKWARD | Op.BACKWARD_INPUT:
            if stage == last_virtual_stage(pp_size, vp_size):
                return None  # the loss stage starts backward from its own loss
            return stage_rank(stage + 1, pp_size, v_shape), Message(Op.BACKWARD, action.microbatch, stage)
        case Op.WEIGHT:
            return None
        case _:
            unhandled_op(action.op)


def produced_message(
    action: Action, pp_rank: int, pp_size: int, vp_size: int, v_shape: bool = False
) -> tuple[int, Message] | None:
    """(destination pp rank, message) that `action` sends when done, or None. The destination is this rank
    itself where the V-shaped placement turns (rank p-1 between its two chunks): a local message."""
    stage = virtual_stage(pp_rank, action.chunk, pp_size, v_shape)
    match action.op:
        case Op.FORWARD:
            if stage == last_virtual_stage(pp_size, vp_size):
                return None
            return stage_rank(stage + 1, pp_size, v_shape), Message(Op.FORWARD, action.microbatch, stage + 1)
        case Op.BACKWARD | Op.BACKWARD_INPUT:
            if stage == 0:
                return None
            return stage_rank(stage - 1, pp_size, v_shape), Message(Op.BACKWARD, action.microbatch, stage - 1)
        case Op.WEIGHT:
            return None
        case _:
            unhandled_op(action.op)


@dataclass(frozen=True)
class Step:
    """One step of a rank's plan: post `ops` as one batch and wait for it, then run action `compute`."""

    ops: tuple[tuple[str, int, Message], ...]  # ("send" | "recv", peer pp rank, message), posting order
    compute: int | None  # index into the rank's action list, or None


def plan_steps(lists: list[list[Action]], vp_size: int, v_shape: bool = False) -> list[list[Step]]:
    """Every rank's communication steps, derived jointly from all ranks' action lists.

    Rounds of a joint replay: in each round every pending send is posted together with the matching
    receive on its destination, as one batch per rank, and then every rank whose next action has its
    input runs that one action (whose output becomes a pending send). Hence
      * per ordered pair, the receiver posts receives in exactly the sender's sending order;
      * every batch is matched in full by the peers' batches of the same round, so a rank never waits on a
        send or receive that its peer posts only after waiting on something of this rank's: no deadlock
        even where NCCL serialises a pair's sends and receives on one stream and a send waits for its
        receive (pp = 2 included, where both directions of a pair carry traffic).
    A local message (the turn of the V-shaped placement) is no op at all: it is there once produced.
    """
    pp_size = len(lists)
    position = [0] * pp_size
    pending: list[list[tuple[int, Message]]] = [[] for _ in range(pp_size)]
    arrived: list[set[Message]] = [set() for _ in range(pp_size)]
    plans: list[list[Step]] = [[] for _ in range(pp_size)]
    # The last round posts the sends of the last actions (no compute left).
    while any(pending) or any(position[r] < len(lists[r]) for r in range(pp_size)):
        ops: list[list[tuple[str, int, Message]]] = [[] for _ in range(pp_size)]
        for src in range(pp_size):  # post every pending send with its receive
            for dst, message in pending[src]:
                ops[src].append(("send", dst, message))
                ops[dst].append(("recv", src, message))
                arrived[dst].add(message)
            pending[src] = []
        progressed = any(ops)
        for r in range(pp_size):  # each rank runs its next action if its input is there
            compute = None
            if position[r] < len(lists[r]):
                action = lists[r][position[r]]
                need = needed_message(action, r, pp_size, vp_size, v_shape)
                if need is None or need[1] in arrived[r]:
                    compute, position[r], progressed = position[r], position[r] + 1, True
                    out = produced_message(action, r, pp_size, vp_size, v_shape)
                    if out is not None and out[0] == r:
                        arrived[r].add(out[1])
                    elif out is not None:
                        pending[r].append(out)
            if ops[r] or compute is not None:
                plans[r].append(Step(tuple(ops[r]), compute))
        if not progressed:
            stuck = {r: lists[r][position[r]] for r in range(pp_size) if position[r] < len(lists[r])}
            raise RuntimeError(f"pipeline action lists deadlock: ranks wait forever at {stuck}")
    return plans


@dataclass
class InFlight:
    """A posted batch: its works, the receive buffers to hand over, the sent tensors kept alive until done."""

    works: list[RecordedWork]
    received: list[tuple[Message, torch.Tensor]]
    sent: list[torch.Tensor]


class StageComm:
    """Runs one rank's plan of batches with batch_isend_irecv (gloo or NCCL).

    Receive buffers are allocated on `device` (the chunks' device). `exchange` posts a step's batch and
    waits for it; `post` and `complete` split the two so that the executor can compute while a batch is in
    flight (overlap): a sent tensor is released when its batch completes.
    """

    def __init__(
        self,
        state: ParallelState,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        scatter_gather: bool,
    ):
        self.state = state
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.numel = math.prod(self.shape)
        # Scatter/gather only when the flattened tensor splits evenly over tp.
        self.scatter = scatter_gather and state.tp_size > 1 and self.numel % state.tp_size == 0
        self.outbox: dict[Message, torch.Tensor] = {}  # computed, to be sent at the next step
        self.inbox: dict[Message, torch.Tensor] = {}  # received, not yet used

    def put(self, message: Message, tensor: torch.Tensor) -> None:
        """Queue `tensor` (detached) to be sent by the step that posts `message`."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(
                f"pipeline message {message} has shape {tuple(tensor.shape)}, expected activation_shape {self.shape}"
            )
        self.outbox[message] = tensor.detach().to(self.dtype).contiguous()

    def deliver_local(self, message: Message, tensor: torch.Tensor) -> None:
        """Hand `tensor` (detached, full size) to this rank's own next consumer: no communication."""
        self.inbox[message] = tensor.detach().to(self.dtype).contiguous()

    def take(self, message: Message) -> torch.Tensor:
        """The received tensor of `message`, shaped like the activation."""
        return self.inbox.pop(message).view(self.shape)

    def post(self, step: Step) -> InFlight | None:
        """Post the step's batch without waiting (None when the step has no messages)."""
        if not step.ops:
            return None
        local = self.numel // self.state.tp_size if self.scatter else self.numel
        ops, received, sent = [], [], []
        for kind, peer, message in step.ops:
            peer_rank = self.state.pp_ranks[peer]
            if kind == "send":
                flat = self.outbox.pop(message).view(-1)
                if self.scatter:  # this tp rank's 1/tp slice
                    flat = flat.narrow(0, self.state.tp_rank * local, local)
                ops.append(P2P("send", flat, peer_rank, self.state.pp_group))
                sent.append(flat)
            else:
                buffer = torch.empty(local, dtype=self.dtype, device=self.device)
                ops.append(P2P("recv", buffer, peer_rank, self.state.pp_group))
                received.append((message, buffer))
        return InFlight(self.state.comm.batch_isend_irecv(ops), received, sent)

    def complete(self, in_flight: InFlight | None) -> None:
        """Wait for a posted batch and hand its received tensors to the inbox (all-gathered over tp when
        scattered). A rank completes its batches in plan order, each before it posts the next."""
        if in_flight is None:
            return
        for work in in_flight.works:
            work.wait()
        for message, buffer in in_flight.received:
            self.inbox[message] = self._gather(buffer) if self.scatter else buffer

    def exchange(self, step: Step) -> None:
        """Post the step's batch and wait for all of it."""
        self.complete(self.post(step))

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        """All-gather the 1/tp slices of a flattened tensor over this stage's tp group."""
        full = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.state.comm.all_gather(list(full.chunk(self.state.tp_size)), piece, self.state.tp_group)
        return full

    def finish(self) -> None:
        """Every message must have been sent and used."""
        if self.outbox or self.inbox:
            raise RuntimeError(f"pipeline messages left over: {list(self.outbox) + list(self.inbox)}")
