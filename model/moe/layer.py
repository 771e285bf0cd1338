"""The Mixture-of-Experts layer: a drop-in for the dense MLP (h -> h on [s, b, h]) that routes each token to
its top-k experts, as megatron-core 0.16.1's MoELayer does in one process (TopKRouter, permute, the experts,
unpermute, plus the shared experts).

The auxiliary losses (the Switch or the sequence-level load-balancing loss, the router z-loss) are not added
to the model's loss: as megatron-core's MoEAuxLossAutoScaler does, each is attached to an activation of the
router so that backward adds its gradient (times `aux_loss_backward_scale`, which the trainer sets to what it
scales the main loss by: 1 / micro-batches, x the loss scale) while the logged loss stays the language-model
loss. Their values are kept in `TopKRouter.last_losses` and summed, with the experts' loads and the dropped
tokens, in `TopKRouter.step_stats` for the logs.

When a micro-batch's tokens are spread over several ranks (`TokenGroup`, model/rank_spec.py: tp under
sequence parallelism, cp), each rank's losses are its part of the micro-batch's: the load-balancing losses
count the selections over the whole group (as megatron-core reduces them over its tp x cp group) and the
z-loss, a mean over tokens, is divided by the group's size, so that the parts' gradients, summed over tp and
cp as every replicated parameter's are, equal one process's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.config import ModelConfig
from model.init import scaled_init_std
from model.kernels import KernelSelection
from model.moe import routing
from model.moe.dispatch import AllToAllDispatcher, ExpertExchange
from model.moe.experts import GroupedExperts, SharedExperts, permute, unpermute
from model.param_info import set_param_info
from model.rank_spec import TokenGroup


class _AttachLoss(torch.autograd.Function):
    """Identity on `activation` whose backward also sends `scale` as the gradient of `loss` (a scalar), so the
    loss reaches the parameters it depends on without being part of the returned loss."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, activation: torch.Tensor, loss: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale  # type: ignore[attr-defined]
        return activation.view_as(activation)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad, torch.full_like(loss, ctx.scale), None  # type: ignore[attr-defined]


@dataclass
class RouterStats:
    """What a router saw since its last `TopKRouter.take_step_stats`, this rank's part of each micro-batch:
    training forwards only (with gradients on). Full recomputation runs a layer's forward twice and so counts
    everything twice, micro-batches included: the ratios the logs show (mean losses, loads over the mean,
    the dropped fraction) and the expert bias step (a sign) come out the same.

    microbatches   forwards counted
    losses         "load_balancing_loss" (Switch or sequence-level), "z_loss" -> sum over those forwards of
                   this rank's part of the loss (coefficient applied)
    expert_load    [E] token assignments each expert computed (after dropping), summed
    assigned       token assignments the router made (T x k per forward), summed
    dropped        of those, assignments capacity dropped, summed
    """

    microbatches: int = 0
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    expert_load: torch.Tensor | None = None
    assigned: int = 0
    dropped: torch.Tensor | None = None


class TopKRouter(nn.Module):
    """The gate: logits = x W^T (+ b) in fp32 whatever the model's dtype, the top-k selection, capacity, the
    auxiliary losses and the expert bias (megatron-core's TopKRouter with moe_router_dtype=fp32).

    weight [E, h] (bias [E] with model.add_bias_linear, as megatron-core); with
    model.moe_router_enable_expert_bias a persistent fp32 buffer `expert_bias` [E] (saved in checkpoints) and
    `tokens_per_expert` [E], the counts since the last `update_expert_bias`.
    """

    expert_bias: torch.Tensor | None
    tokens_per_expert: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, token_group: TokenGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.token_group = token_group or TokenGroup()
        num_experts = cfg.num_experts or 0
        self.weight = nn.Parameter(torch.empty(num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if cfg.add_bias_linear else None
        enabled = cfg.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(num_experts) if enabled else None)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts) if enabled else None, persistent=False)
        self.last_losses: dict[str, torch.Tensor] = {}  # name -> value (coefficient applied) of the last forward
        self.step_stats = RouterStats()

    def reset_parameters(self) -> None:
        """normal(0, init_std) weight, zero bias and expert bias."""
        nn.init.normal_(self.weight, 0.0, self.cfg.init_std)
        for tensor in (self.bias, self.expert_bias):
            if tensor is not None:
                nn.init.zeros_(tensor)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T, h] -> router logits [T, E] in fp32."""
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(tokens.float(), self.weight.float(), bias)

    def forward(
        self, tokens: torch.Tensor, seq_length: int, batch_size: int, loss_scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T = s x b, h] (sequence first) -> (routing probs [T, E] fp32, routing map [T, E] bool).

        In training with gradients on, the z-loss is attached to the logits and the load-balancing loss to
        the probs (backward adds their gradients times `loss_scale`), and the selections are counted for the
        expert bias."""
        cfg = self.cfg
        topk = cfg.moe_router_topk
        logits = self.logits(tokens)
        self.last_losses = {}
        adds_losses = self.training and torch.is_grad_enabled()
        if adds_losses and cfg.moe_z_loss_coeff is not None:
            # a mean over this rank's tokens: its part of the micro-batch's mean is 1 / group size of it
            z_loss = routing.z_loss(logits, cfg.moe_z_loss_coeff / self.token_group.size)
            self.last_losses["z_loss"] = z_loss.detach()
            logits = _AttachLoss.apply(logits, z_loss, loss_scale)
        probs, routing_map = routing.topk_routing(
            logits,
            topk,
            cfg.moe_router_score_function,
            cfg.moe_router_pre_softmax,
            cfg.moe_router_topk_scaling_factor,
            self.expert_bias,
        )
        selected = routing_map
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = routing.drop_tokens(
                probs,
                routing_map,
                topk,
                cfg.moe_expert_capacity_factor,
                cfg.moe_token_drop_policy,
                cfg.moe_pad_expert_input_to_capacity,
            )
        balancing = cfg.moe_router_load_balancing_type
        if adds_losses and cfg.moe_aux_loss_coeff > 0 and balancing != "none":
            aux_loss = self._load_balancing_loss(logits, seq_length, batch_size)
            self.last_losses[balancing] = aux_loss.detach()
            probs = _AttachLoss.apply(probs, aux_loss, loss_scale)
        if torch.is_grad_enabled():  # training forwards, not evaluation
            with torch.no_grad():
                if self.tokens_per_expert is not None:
                    self.tokens_per_expert += routing_map.sum(dim=0)
                if self.training:
                    self._count(selected, routing_map)
        return probs, routing_map

    def _load_balancing_loss(self, logits: torch.Tensor, seq_length: int, batch_size: int) -> torch.Tensor:
        """This rank's part of the Switch or sequence-level loss: its tokens' scores against the selections
        counted over the token group (routing.switch_load_balancing_loss, routing.sequence_load_balancing_loss,
        which these equal on one rank)."""
        cfg, group = self.cfg, self.token_group
        topk, num_experts, coeff = cfg.moe_router_topk, cfg.num_experts or 0, cfg.moe_aux_loss_coeff
        map_for_loss, scores = routing.scores_for_aux_loss(logits, topk, cfg.moe_router_score_function)
        if cfg.moe_router_load_balancing_type == "seq_aux_loss":
            # [s, b x E]: each sequence's experts are columns of their own; the group holds parts of the same
            # b sequences, so the columns' counts add up over it
            counts = group.sum_counts(map_for_loss.reshape(seq_length, -1).sum(dim=0))
            loss = routing.switch_load_balancing_loss(
                scores.reshape(seq_length, -1), counts, seq_length * group.size, topk, num_experts, coeff
            )
            return loss / batch_size
        counts = group.sum_counts(map_for_loss.sum(dim=0))
        return routing.switch_load_balancing_loss(
            scores, counts, logits.shape[0] * group.size, topk, num_experts, coeff
        )

    def _count(self, selected: torch.Tensor, kept: torch.Tensor) -> None:
        """Add one forward to `step_stats`: selected [T, E] the top-k choices, kept [T, E] what the experts
        compute after capacity (with padding it also holds rows of tokens not routed there)."""
        stats = self.step_stats
        load = torch.logical_and(selected, kept).sum(dim=0)
        dropped = selected.sum() - load.sum()
        stats.microbatches += 1
        stats.assigned += selected.shape[0] * self.cfg.moe_router_topk
        stats.expert_load = load if stats.expert_load is None else stats.expert_load + load
        stats.dropped = dropped if stats.dropped is None else stats.dropped + dropped
        for name, value in self.last_losses.items():
            key = name if name == "z_loss" else "load_balancing_loss"  # Switch or sequence-level, as configured
            stats.losses[key] = stats.losses[key] + value if key in stats.losses else value

    def take_step_stats(self) -> RouterStats:
        """The statistics since the last call (see RouterStats); counting restarts."""
        stats, self.step_stats = self.step_stats, RouterStats()
        return stats

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """One aux-loss-free balancing step from the selections counted since the last one (megatron-core runs
        it after each optimizer step, on counts summed over tp x dp x cp); the counts restart at zero."""
        if self.expert_bias is None or self.tokens_per_expert is None:
            raise ValueError("update_expert_bias needs model.moe_router_enable_expert_bias=true")
        rate = self.cfg.moe_router_bias_update_rate
        self.expert_bias.copy_(routing.updated_expert_bias(self.tokens_per_expert, self.expert_bias, rate))
        self.tokens_per_expert.zero_()


class MoELayer(nn.Module):
    """Routed experts (+ shared experts) in place of the dense MLP: [s, b, h] -> ([s, b, h], None), the
    second item standing for the dense MLP's deferred fc2 bias (the MoE layer adds its biases itself).

    `use_grouped_mm` False computes the experts one torch.mm each (the reference of the grouped multiply).
    `aux_loss_backward_scale` is the factor of the auxiliary losses' gradients (see the module docstring).
    `expert_exchange` (expert parallelism, given by parallel/expert_parallel.py): the layer holds only its ep
    rank's E / ep experts, marked with their global range in ParamInfo.experts, and `dispatcher` sends tokens
    to their experts' ranks (model/moe/dispatch.py); None: every expert here, computed locally.
    `token_group`: the ranks holding the other parts of each micro-batch (default: this rank alone).
    `kernels`: the fused kernels (model/kernels); grouped_mm among them runs the experts' multiplies as the
    Triton kernel (None: no fused kernel).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        use_grouped_mm: bool = True,
        expert_exchange: ExpertExchange | None = None,
        token_group: TokenGroup | None = None,
        kernels: KernelSelection | None = None,
    ):
        super().__init__()
        if not cfg.num_experts:
            raise ValueError(f"model.num_experts={cfg.num_experts}: an MoE layer needs experts")
        self.router = TopKRouter(cfg, token_group)
        self.dispatcher = None if expert_exchange is None else AllToAllDispatcher(expert_exchange, cfg.num_experts)
        local_experts = cfg.num_experts if self.dispatcher is None else self.dispatcher.num_local_experts
        self.experts = GroupedExperts(
            local_experts,
            cfg.hidden_size,
            cfg.moe_ffn_size,
            cfg.activation,
            cfg.add_bias_linear,
            use_grouped_mm,
            kernels,
        )
        if self.dispatcher is not None:
            for param in self.experts.parameters():
                set_param_info(
                    param, full_shape=(cfg.num_experts, *param.shape[1:]), experts=self.dispatcher.expert_range
                )
        self.shared_experts = None
        if cfg.moe_shared_expert_ffn_hidden_size:
            self.shared_experts = SharedExperts(
                cfg.hidden_size,
                cfg.moe_shared_expert_ffn_hidden_size,
                cfg.activation,
                cfg.add_bias_linear,
                cfg.moe_shared_expert_gate,
            )
        self.aux_loss_backward_scale = 1.0
        if not self.router.weight.is_meta:  # on the meta device (the trainer's build) model/init.py draws them
            self.reset_parameters(cfg)

    def reset_parameters(self, cfg: ModelConfig) -> None:
        """Megatron's init: normal(0, init_std), the output projections (fc2) at init_std / sqrt(2 x layers)."""
        self.router.reset_parameters()
        self.experts.reset_parameters(cfg.init_std, scaled_init_std(cfg))
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(cfg.init_std, scaled_init_std(cfg))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """[s, b, h] -> ([s, b, h], None)."""
        seq_length, batch_size, hidden = x.shape
        tokens = x.reshape(-1, hidden)  # [T, h], token t = position t // b of sequence t % b
        probs, routing_map = self.router(tokens, seq_length, batch_size, self.aux_loss_backward_scale)
        if self.dispatcher is not None:
            out = self.dispatcher(tokens, probs, routing_map, self.experts)
        else:
            permuted, permuted_probs, sorted_indices, tokens_per_expert = permute(tokens, routing_map, probs)
            expert_out = self.experts(permuted, permuted_probs, tokens_per_expert)  # [P, h]
            out = unpermute(expert_out, sorted_indices, tokens.shape[0])
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(seq_length, batch_size, hidden), None
