"""Point-to-point messages between pipeline stages, posted in an order that cannot mismatch or deadlock.

Which messages exist follows from the action lists alone: the forward of virtual stage k sends an activation
to stage k+1, the backward of stage k sends an input-gradient to stage k-1. NCCL ignores tags and matches
the messages between two ranks by order, so for every ordered pair (sender, receiver) the receiver must post
its receives in the order the sender posts its sends. Schedules are pure functions, so each rank rebuilds
its peers' lists (`incoming_order`) and, when an action needs a message, first posts the receives of every
earlier message from that peer (`plan_receives`). Sends are non-blocking and waited on only at the end of
the iteration, so a rank blocks only on a receive it needs now; the simulator proves each schedule's
dependencies acyclic, hence the executor cannot deadlock (at pp = 2 too, where both directions of a
pair carry traffic).

Scatter/gather (paper section 4.1): with tp > 1 and no sequence parallelism every tp rank of a stage holds
the same activation, so each sends only its 1/tp slice of the flattened tensor and the receiving stage
all-gathers the slices over its tp group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.pipeline.schedules import Action, RankSchedule, virtual_stage


@dataclass(frozen=True)
class Message:
    """One tensor sent between virtual stages: an activation ("F") or an input-gradient ("B")."""

    kind: str  # "F" (activation, forward direction) or "B" (gradient, backward direction)
    microbatch: int
    stage: int  # the receiving virtual stage


def needed_message(action: Action, pp_rank: int, pp_size: int, vp_size: int) -> tuple[int, Message] | None:
    """(source pp rank, message) that `action` must receive first, or None."""
    stage = virtual_stage(pp_rank, action.chunk, pp_size)
    if action.op == "F":
        if stage == 0:
            return None
        return (stage - 1) % pp_size, Message("F", action.microbatch, stage)
    if stage == pp_size * vp_size - 1:
        return None  # the loss stage starts backward from its own loss
    return (stage + 1) % pp_size, Message("B", action.microbatch, stage)


def produced_message(action: Action, pp_rank: int, pp_size: int, vp_size: int) -> tuple[int, Message] | None:
    """(destination pp rank, message) that `action` sends when done, or None."""
    stage = virtual_stage(pp_rank, action.chunk, pp_size)
    if action.op == "F":
        if stage == pp_size * vp_size - 1:
            return None
        return (stage + 1) % pp_size, Message("F", action.microbatch, stage + 1)
    if stage == 0:
        return None
    return (stage - 1) % pp_size, Message("B", action.microbatch, stage - 1)


def outgoing_order(actions: list[Action], pp_rank: int, pp_size: int, vp_size: int) -> dict[int, list[Message]]:
    """Per destination pp rank, the messages this rank sends, in posting order."""
    order: dict[int, list[Message]] = {}
    for action in actions:
        out = produced_message(action, pp_rank, pp_size, vp_size)
        if out is not None:
            order.setdefault(out[0], []).append(out[1])
    return order


def incoming_order(peer_lists: list[list[Action]], pp_rank: int, vp_size: int) -> dict[int, list[Message]]:
    """Per source pp rank, the messages it sends to `pp_rank`, in the order it posts them."""
    pp_size = len(peer_lists)
    incoming = {}
    for src, actions in enumerate(peer_lists):
        sent = outgoing_order(actions, src, pp_size, vp_size).get(pp_rank, [])
        if sent:
            incoming[src] = sent
    return incoming


def plan_receives(peer_lists: list[list[Action]], pp_rank: int, vp_size: int) -> list[list[tuple[int, Message]]]:
    """For each of this rank's actions, the receives to post just before it, in posting order.

    An action that needs message X from rank q posts every not-yet-posted message from q up to and
    including X: the receiver's posting order per source is then exactly the source's sending order.
    Messages from this rank to itself (pp = 1 with vp > 1) are handed over locally and never posted.
    """
    pp_size = len(peer_lists)
    incoming = incoming_order(peer_lists, pp_rank, vp_size)
    posted = {src: 0 for src in incoming}
    position = {(src, msg): i for src, queue in incoming.items() for i, msg in enumerate(queue)}
    plan = []
    for action in peer_lists[pp_rank]:
        need = needed_message(action, pp_rank, pp_size, vp_size)
        step = []
        if need is not None and need[0] != pp_rank:
            src, message = need
            queue = incoming[src]
            while posted[src] <= position[(src, message)]:
                step.append((src, queue[posted[src]]))
                posted[src] += 1
        plan.append(step)
    return plan


class StageComm:
    """Runs one rank's receive plan and its sends with isend/irecv (gloo or NCCL).

    Receive buffers are allocated on `device` (the chunks' device). Local messages (a rank sending to
    itself) go through a mailbox. Sends are waited on at `finish()`; the sent tensor stays alive inside
    the work until then, so the caller may drop its own reference (and `.data`) right after `send`.
    """

    def __init__(self, state, schedule: RankSchedule, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, scatter_gather: bool):
        self.state = state
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        numel = 1
        for size in self.shape:
            numel *= size
        self.numel = numel
        # Scatter/gather only when the flattened tensor splits evenly over tp.
        self.scatter = scatter_gather and state.tp_size > 1 and numel % state.tp_size == 0
        lists = [schedule.for_rank(r) if r != state.pp_rank else schedule for r in range(state.pp_size)]
        self.plan = plan_receives(lists, state.pp_rank, schedule.vp_size)
        self.pending_recv: dict[Message, tuple[torch.Tensor, object]] = {}
        self.mailbox: dict[Message, torch.Tensor] = {}
        self.pending_send: list[tuple[object, torch.Tensor]] = []

    def _peer(self, pp_rank: int) -> int:
        return self.state.pp_ranks[pp_rank]

    def receive(self, index: int, need: tuple[int, Message]) -> torch.Tensor:
        """Post the receives planned before action `index`, then wait for and return `need`'s tensor."""
        src, message = need
        if src == self.state.pp_rank:
            return self.mailbox.pop(message)
        for peer, planned in self.plan[index]:
            size = self.numel // self.state.tp_size if self.scatter else self.numel
            buffer = torch.empty(size, dtype=self.dtype, device=self.device)
            work = dist.irecv(buffer, src=self._peer(peer), group=self.state.pp_group)
            self.pending_recv[planned] = (buffer, work)
        buffer, work = self.pending_recv.pop(message)
        work.wait()
        if self.scatter:
            buffer = self._gather(buffer)
        return buffer.view(self.shape)

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        """All-gather the 1/tp slices of a flattened tensor over this stage's tp group."""
        full = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        dist.all_gather(list(full.chunk(self.state.tp_size)), piece, group=self.state.tp_group)
        return full

    def send(self, dst: int, message: Message, tensor: torch.Tensor) -> None:
        """Post a non-blocking send of `tensor` (detached; the work keeps its storage alive)."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"pipeline message {message} has shape {tuple(tensor.shape)}, "
                             f"expected activation_shape {self.shape}")
        data = tensor.detach().to(self.dtype).contiguous()
        if dst == self.state.pp_rank:
            self.mailbox[message] = data.clone()
            return
        flat = data.view(-1)
        if self.scatter:
            size = self.numel // self.state.tp_size
            flat = flat.narrow(0, self.state.tp_rank * size, size)
        work = dist.isend(flat, dst=self._peer(dst), group=self.state.pp_group)
        self.pending_send.append((work, flat))
        # Drop completed sends so their buffers are freed as early as possible.
        self.pending_send = [(w, t) for w, t in self.pending_send if not w.is_completed()]

    def finish(self) -> None:
        """Wait for every send; every planned receive has been consumed by then."""
        for work, _ in self.pending_send:
            work.wait()
        self.pending_send.clear()
        if self.pending_recv or self.mailbox:
            raise RuntimeError(f"pipeline messages left unconsumed: {list(self.pending_recv) + list(self.mailbox)}")
