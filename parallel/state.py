"""The parallel state: process groups and ranks of one PTD-P layout, built once and passed explicitly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from parallel.comm import Collectives
from parallel.comm_recorder import CommRecorder
from parallel.group_setup import creating_group
from parallel.layout import Layout, derive_dp_size
from parallel.pipeline.stages import StageMap
from parallel.rank_grid import RankGrid


@dataclass
class ParallelState:
    """Ranks and process groups of a tp x cp x dp x pp layout (plus vp model chunks per pipeline rank).

    Rank order: parallel/rank_grid.py (Megatron-LM's: tp varies fastest, then cp, dp, pp), from which
    every group here is built. The embedding group holds the pipeline ranks of one (tp_rank, cp_rank,
    dp_rank) column that keep a copy of a tied word embedding (`StageMap.embedding_pp_ranks`: the first and
    the last stage; they all-reduce its gradient over this group). Under zb-v's V placement one rank holds
    both copies and sums them itself: no rank gets an embedding group then.

    Context parallelism (cp) splits each micro-batch's sequence over the cp group; its ranks hold replicas of
    every parameter, so gradients and the distributed optimizer's shards go over `dp_cp_group` (dp x cp),
    while the data (which samples a rank reads) follows the dp rank alone. With cp = 1, dp_cp_group is
    dp_group itself (and no group is created for it).

    Expert parallelism (ep) re-divides each dp x cp group for the experts of MoE layers, as megatron-core does
    (parallel/rank_grid.py, `RankGrid.experts`): `ep_group` is ep consecutive members of it (they hold
    different experts and exchange tokens by all-to-all), `expert_dp_group` the dp x cp / ep ranks that hold
    the same experts (expert gradients are reduced over it instead of dp x cp). With ep = 1 no group is
    created: ep_group is None and expert_dp_group is dp_cp_group.

    `comm` is the one door for every collective and p2p on these groups (parallel/comm.py), which knows each
    group by the dimensions it spans and reports every call to its recorder, if any.

    Build it with `ParallelState.create(...)` after `torch.distributed.init_process_group`; build a
    single-process state (no torch.distributed) with `ParallelState.single()`.
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    vp_size: int = 1
    cp_size: int = 1
    v_shape: bool = False  # zb-v's V placement of the two chunks per rank (parallel/pipeline/stages.py)
    tp_group: ProcessGroup | None = None
    cp_group: ProcessGroup | None = None  # ring attention's group: ranks holding other chunks of the same sequence
    dp_x_cp_group: ProcessGroup | None = None  # the dp x cp group when cp > 1 (read it as `dp_cp_group`)
    pp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    model_parallel_group: ProcessGroup | None = None  # tp x pp ranks sharing one dp_rank
    embedding_group: ProcessGroup | None = None  # None unless this rank holds one of the tied copies on two ranks
    ep_size: int = 1  # expert-parallel size (a re-division of dp x cp, see the class docstring)
    ep_group: ProcessGroup | None = None  # this rank's ep group when ep > 1
    ep_dp_group: ProcessGroup | None = None  # the expert-dp group when ep > 1 (read it as `expert_dp_group`)
    ep_ranks: list[int] = field(default_factory=list)
    expert_dp_ranks: list[int] = field(default_factory=list)
    fsdp_replicate: int = 1  # HSDP: the dp x cp ranks as this many replicas of an FSDP-sharded model
    hsdp_shard_group: ProcessGroup | None = None  # HSDP only: this rank's replica (dp x cp / fsdp_replicate ranks)
    hsdp_replicate_group: ProcessGroup | None = (
        None  # HSDP only: the ranks holding the same shard in the other replicas
    )
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of this rank's pipeline, by stage
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    cp_ranks: list[int] = field(default_factory=list)
    comm: Collectives = field(default_factory=Collectives)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def single(cls) -> ParallelState:
        """The layout of one process: every group is None and every collective is skipped."""
        return cls(
            world_size=1,
            rank=0,
            tp_size=1,
            pp_size=1,
            dp_size=1,
            vp_size=1,
            pp_ranks=[0],
            tp_ranks=[0],
            dp_ranks=[0],
            cp_ranks=[0],
        )

    @classmethod
    def from_layout(
        cls, layout: Layout, recorder: CommRecorder | None = None, timeout_s: float | None = None
    ) -> ParallelState:
        """The state of `layout` for this process: `single()` for one process, else `create(...)`; `recorder`
        sees every collective issued through `comm`; `timeout_s` is the groups' timeout (None: torch's)."""
        if layout.world_size == 1:
            state = cls.single()
            state.comm.recorder = recorder
            return state
        return cls.create(
            layout.tp_size,
            layout.pp_size,
            layout.vp_size,
            layout.cp_size,
            layout.stages.v_shape,
            recorder,
            timeout_s,
            layout.fsdp_replicate if layout.fsdp else 1,
            layout.ep_size,
        )

    @classmethod
    def create(
        cls,
        tp_size: int,
        pp_size: int,
        vp_size: int = 1,
        cp_size: int = 1,
        v_shape: bool = False,
        recorder: CommRecorder | None = None,
        timeout_s: float | None = None,
        fsdp_replicate: int = 1,
        ep_size: int = 1,
    ) -> ParallelState:
        """Build every group; all ranks must call this in the same order (new_group is collective).
        `timeout_s`: the timeout of the new groups' creation and collectives (None: torch's default, not the
        world's); a creation that times out raises GroupCreationTimeout (parallel/group_setup.py).
        `fsdp_replicate` > 1 adds HSDP's two groups (`_create_hsdp_groups`), `ep_size` > 1 the ep and
        expert-dp groups (`_create_expert_groups`)."""
        world_size, rank = dist.get_world_size(), dist.get_rank()
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None

        def new_group(ranks: list[int]) -> ProcessGroup:  # (torch's sentinel on non-members, never kept)
            with creating_group(f"the process group of ranks {ranks}", rank, timeout_s):
                return dist.new_group(ranks, timeout=timeout)

        dp_size = derive_dp_size(world_size, tp_size, pp_size, cp_size)
        state = cls(
            world_size=world_size,
            rank=rank,
            tp_size=tp_size,
            pp_size=pp_size,
            dp_size=dp_size,
            vp_size=vp_size,
            cp_size=cp_size,
            v_shape=v_shape,
            fsdp_replicate=fsdp_replicate,
            ep_size=ep_size,
            comm=Collectives(recorder),
        )
        grid = state.grid
        for ranks in grid.groups("tp"):
            group = new_group(ranks)
            if rank in ranks:
                state.tp_group, state.tp_ranks = state._named(group, "tp", ranks), ranks
        for ranks in grid.groups("dp"):
            group = new_group(ranks)
            if rank in ranks:
                state.dp_group, state.dp_ranks = state._named(group, "dp", ranks), ranks
        for ranks in grid.groups("pp"):
            group = new_group(ranks)
            if rank in ranks:
                state.pp_group, state.pp_ranks = state._named(group, "pp", ranks), ranks
            embedding_ranks = [ranks[pp_rank] for pp_rank in state.stages.embedding_pp_ranks]
            emb_group = new_group(embedding_ranks)
            if rank in embedding_ranks and len(embedding_ranks) > 1:
                state.embedding_group = state._named(emb_group, "embedding", embedding_ranks)
        for ranks in grid.groups("tp", "pp"):
            group = new_group(ranks)
            if rank in ranks:
                state.model_parallel_group = state._named(group, "tp_pp", ranks)
        if cp_size > 1:  # new groups only with cp: a cp = 1 run creates exactly the groups it did before
            state._create_cp_groups(new_group)
        if fsdp_replicate > 1:
            state._create_hsdp_groups(new_group)
        if ep_size > 1:  # as with cp: an ep = 1 run creates exactly the groups it did before
            state._create_expert_groups(new_group)
        return state

    def _create_expert_groups(self, new_group: Callable[[list[int]], ProcessGroup]) -> None:
        """The ep groups, then the expert-dp groups, each from the experts' grid (megatron-core's order of
        creation: its expert model parallel groups come before its expert data parallel groups)."""
        experts = self.expert_grid
        for ranks in experts.groups("ep"):
            group = new_group(ranks)
            if self.rank in ranks:
                self.ep_group, self.ep_ranks = self._named(group, "ep", ranks), ranks
        for ranks in experts.groups("expert_dp"):
            group = new_group(ranks)
            if self.rank in ranks:
                self.ep_dp_group, self.expert_dp_ranks = self._named(group, "expert_dp", ranks), ranks

    def _create_hsdp_groups(self, new_group: Callable[[list[int]], ProcessGroup]) -> None:
        """HSDP cuts each dp x cp group (in dp_cp_rank order) into `fsdp_replicate` replicas of consecutive
        ranks: FSDP shards over a replica ("dp_shard") and all-reduces over the ranks holding the same shard
        in every replica ("dp_replicate"), as torchtitan's dp_replicate (outer) and dp_shard x cp (inner)."""
        shard = self.dp_cp_size // self.fsdp_replicate
        for ranks in self.grid.groups("cp", "dp"):  # ascending = dp_cp_rank order (cp varies faster)
            replicas = [ranks[i * shard : (i + 1) * shard] for i in range(self.fsdp_replicate)]
            for members in replicas:
                group = new_group(members)
                if self.rank in members:
                    self.hsdp_shard_group = self._named(group, "dp_shard", members)
            for index in range(shard):
                members = [replica[index] for replica in replicas]
                group = new_group(members)
                if self.rank in members:
                    self.hsdp_replicate_group = self._named(group, "dp_replicate", members)

    def _create_cp_groups(self, new_group: Callable[[list[int]], ProcessGroup]) -> None:
        for ranks in self.grid.groups("cp"):
            group = new_group(ranks)
            if self.rank in ranks:
                self.cp_group, self.cp_ranks = self._named(group, "cp", ranks), ranks
        for ranks in self.grid.groups("cp", "dp"):
            group = new_group(ranks)
            if self.rank in ranks:
                self.dp_x_cp_group = self._named(group, "dp_cp", ranks)

    def _named(self, group: ProcessGroup, name: str, ranks: list[int]) -> ProcessGroup:
        """`group`, registered under `name` with `comm` (the records name groups by their dimensions)."""
        self.comm.register(group, name, len(ranks))
        return group

    # ---- coordinates --------------------------------------------------------------------------
    @property
    def grid(self) -> RankGrid:
        """This layout's rank grid (the rank order)."""
        return RankGrid.of(self)

    @property
    def expert_grid(self) -> RankGrid:
        """The experts' view of the ranks: tp, ep, expert_dp, pp (parallel/rank_grid.py)."""
        return self.grid.experts(self.ep_size)

    @property
    def stages(self) -> StageMap:
        """Where the virtual stages sit (parallel/pipeline/stages.py)."""
        return StageMap(self.pp_size, self.vp_size, self.v_shape)

    @property
    def tp_rank(self) -> int:
        return self.grid.coord(self.rank, "tp")

    @property
    def dp_rank(self) -> int:
        return self.grid.coord(self.rank, "dp")

    @property
    def cp_rank(self) -> int:
        return self.grid.coord(self.rank, "cp")

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        """Group of the replicas of every parameter (dp x cp): gradient reduction, optimizer shards."""
        return self.dp_group if self.cp_size == 1 else self.dp_x_cp_group

    @property
    def dp_cp_size(self) -> int:
        """Replicas of every parameter: gradients are reduced and optimizer states sharded over dp x cp."""
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in its dp x cp group (cp varies faster, as in the rank order)."""
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def ep_rank(self) -> int:
        """This rank's index in its ep group: which block of num_experts / ep experts it holds."""
        return self.expert_grid.coord(self.rank, "ep")

    @property
    def expert_dp_size(self) -> int:
        """Replicas of each expert weight: dp x cp / ep."""
        return self.dp_cp_size // self.ep_size

    @property
    def expert_dp_rank(self) -> int:
        """This rank's index in its expert-dp group (the distributed optimizer's shard of expert buckets)."""
        return self.expert_grid.coord(self.rank, "expert_dp")

    @property
    def expert_dp_group(self) -> ProcessGroup | None:
        """Group of the replicas of every expert weight (dp x cp / ep): expert gradient reduction and shards."""
        return self.dp_cp_group if self.ep_size == 1 else self.ep_dp_group

    @property
    def pp_rank(self) -> int:
        return self.grid.coord(self.rank, "pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping: the last stage's next is the first)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        """This rank's coordinates, for the start-up log (the layout itself: `Layout.describe`)."""
        cp = f", cp_rank {self.cp_rank}" if self.cp_size > 1 else ""
        ep = f", ep_rank {self.ep_rank}, expert_dp_rank {self.expert_dp_rank}" if self.ep_size > 1 else ""
        return f"rank {self.rank} is tp_rank {self.tp_rank}{cp}, dp_rank {self.dp_rank}, pp_rank {self.pp_rank}{ep}"
