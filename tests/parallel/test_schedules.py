"""Schedules tested as data: action lists, their communication plans and their simulated bubbles."""

import itertools
from enum import Enum

import pytest

from parallel.layout import SCHEDULES, LayoutError, check_schedule, uses_v_shape
from parallel.pipeline.p2p import Message, plan_steps, produced_message
from parallel.pipeline.plan import _last_backward_indices
from parallel.pipeline.schedules import Action, Op, build_forward_only, build_schedule
from parallel.pipeline.simulator import CommPlan, simulate, simulate_schedule
from parallel.pipeline.stages import virtual_stage

pytestmark = pytest.mark.tier("fast")


def layouts(ms=(1, 2, 3, 4, 6, 8, 12), ps=(1, 2, 3, 4), vs=(1, 2, 3)):
    """Every valid (schedule, p, m, v) of the grid, each resolved schedule once."""
    seen = set()
    for schedule, p, m, v in itertools.product(SCHEDULES, ps, ms, vs):
        try:
            resolved = check_schedule(schedule, p, v, m)
        except LayoutError:
            continue
        if (resolved, p, m, v) not in seen:
            seen.add((resolved, p, m, v))
            yield resolved, p, m, v


def outgoing_order(
    actions: list[Action], pp_rank: int, pp_size: int, vp_size: int, v_shape: bool = False
) -> dict[int, list[Message]]:
    """Per destination pp rank, the messages a rank's list sends, in list order."""
    order: dict[int, list[Message]] = {}
    for action in actions:
        out = produced_message(action, pp_rank, pp_size, vp_size, v_shape)
        if out is not None:
            order.setdefault(out[0], []).append(out[1])
    return order


def all_lists(schedule, p, m, v):
    if schedule == "forward_only":
        return [build_forward_only(p, r, m, v) for r in range(p)]
    return [build_schedule(schedule, p, r, m, v) for r in range(p)]


def leading_forwards(actions):
    return next((i for i, a in enumerate(actions) if a.op is Op.BACKWARD), len(actions))


# ---- the lists ------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,p,m,v", list(layouts()))
def test_each_forward_and_backward_once_backward_after_forward(schedule, p, m, v):
    for r in range(p):
        actions = build_schedule(schedule, p, r, m, v)
        expected = {(i, c) for i in range(m) for c in range(v)}
        forwards = [(a.microbatch, a.chunk) for a in actions if a.op is Op.FORWARD]
        if schedule.startswith("zb-"):  # split backward: the input part, then the weight part
            inputs = [(a.microbatch, a.chunk) for a in actions if a.op is Op.BACKWARD_INPUT]
            weights = [(a.microbatch, a.chunk) for a in actions if a.op is Op.WEIGHT]
            assert sorted(forwards) == sorted(expected) == sorted(inputs) == sorted(weights)
            assert len(actions) == 3 * len(expected)
            for key in expected:
                order = [actions.index(Action(op, *key)) for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.WEIGHT)]
                assert order == sorted(order)
            continue
        backwards = [(a.microbatch, a.chunk) for a in actions if a.op is Op.BACKWARD]
        assert sorted(forwards) == sorted(expected) == sorted(backwards)
        for key in expected:
            assert actions.index(Action(Op.FORWARD, *key)) < actions.index(Action(Op.BACKWARD, *key))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (3, 5), (2, 1), (5, 5)])
def test_1f1b_warmup_and_memory(p, m):
    for r in range(p):
        actions = build_schedule("1f1b", p, r, m)
        warmup = min(p - r - 1, m)
        assert leading_forwards(actions) == min(warmup + 1, m)
        assert actions[:warmup] == [Action(Op.FORWARD, i, 0) for i in range(warmup)]


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 4, 2), (2, 4, 3), (3, 6, 2), (4, 16, 4)])
def test_interleaved_warmup(p, m, v):
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
        assert leading_forwards(build_schedule("interleaved", p, r, m, v)) == min(warmup + 1, m * v)


def test_interleaved_order_is_megatrons():
    F, B = (lambda i, c: Action(Op.FORWARD, i, c)), (lambda i, c: Action(Op.BACKWARD, i, c))
    assert build_schedule("interleaved", 2, 0, 4, 2) == [
        F(0, 0),
        F(1, 0),
        F(0, 1),
        F(1, 1),  # warm-up: 2*(p-r-1) + (v-1)*p = 4
        F(2, 0),
        B(0, 1),
        F(3, 0),
        B(1, 1),
        F(2, 1),
        B(0, 0),
        F(3, 1),
        B(1, 0),  # steady 1F1B
        B(2, 1),
        B(3, 1),
        B(2, 0),
        B(3, 0),
    ]  # cool-down


def test_virtual_stage_and_single_stage():
    assert [virtual_stage(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))
    assert [virtual_stage(r, c, 4, v_shape=True) for c in range(2) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    for schedule in (s for s in SCHEDULES if s != "zb-v"):  # zb-v needs two chunks, hence a pipeline
        assert build_schedule(schedule, 1, 0, 2) == [
            Action(Op.FORWARD, 0, 0),
            Action(Op.BACKWARD, 0, 0),
            Action(Op.FORWARD, 1, 0),
            Action(Op.BACKWARD, 1, 0),
        ]


@pytest.mark.parametrize(
    "args,words",
    [
        (("interleaved", 4, 6, 2), ["(6)", "pp_size=4", "4, 8, 12"]),
        (("gpipe", 4, 8, 2), ["vp_size=2", "interleaved"]),
        (("interleaved", 1, 4, 2), ["vp_size=2", "pp_size > 1"]),
        (("zigzag", 4, 8, 1), ["zigzag", "gpipe"]),
        (("gpipe", 2, 0, 1), ["micro-batches (0)"]),
        (("zb-v", 4, 8, 1), ["zb-v", "vp_size=2", "got vp_size=1"]),
        (("zb-h1", 4, 8, 2), ["zb-h1", "vp_size=1", "got 2"]),
    ],
)
def test_invalid_layouts_name_the_values(args, words):
    with pytest.raises(LayoutError) as error:
        build_schedule(args[0], args[1], 0, args[2], args[3])
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words)


def test_1f1b_with_virtual_stages_is_interleaved_everywhere():
    """Megatron's rule, applied by layout.py for the config and the schedule builder alike."""
    for r in range(4):
        assert build_schedule("1f1b", 4, r, 8, 2) == build_schedule("interleaved", 4, r, 8, 2)


# ---- the communication plan ---------------------------------------------------------------------
def strict_rendezvous_completes(plans) -> bool:
    """Run the plans under NCCL's worst case: one stream per rank, a batch starts when the previous one is
    done, and every send/receive completes only when its counterpart is in the peer's current batch."""
    current = [0] * len(plans)

    def matched(r: int) -> bool:  # every op of r's current batch has its counterpart in the peer's
        return all(
            current[peer] < len(plans[peer])
            and ("recv" if kind == "send" else "send", r, message) in plans[peer][current[peer]].ops
            for kind, peer, message in plans[r][current[r]].ops
        )

    while any(current[r] < len(plans[r]) for r in range(len(plans))):
        done = [r for r in range(len(plans)) if current[r] < len(plans[r]) and matched(r)]
        if not done:
            return False
        for r in done:  # batches complete together with their counterparts
            current[r] += 1
    return True


@pytest.mark.parametrize(
    "schedule,p,m,v",
    list(layouts(ms=(1, 2, 3, 4, 8)))
    + [("forward_only", p, m, v) for p in (1, 2, 3, 4) for m in (1, 3, 4) for v in (1, 2, 3)],
)
def test_receivers_post_in_senders_order_and_never_deadlock(schedule, p, m, v):
    lists = all_lists(schedule, p, m, v)
    v_shape = uses_v_shape(schedule)
    plans = plan_steps(lists, v, v_shape)
    for r in range(p):  # every action runs once, in list order
        assert [s.compute for s in plans[r] if s.compute is not None] == list(range(len(lists[r])))
    for src, dst in itertools.product(range(p), repeat=2):
        sent = [msg for s in plans[src] for kind, peer, msg in s.ops if kind == "send" and peer == dst]
        received = [msg for s in plans[dst] for kind, peer, msg in s.ops if kind == "recv" and peer == src]
        if src == dst:  # the turn of zb-v's V is local: no message at all
            assert sent == received == []
            continue
        assert sent == received == outgoing_order(lists[src], src, p, v, v_shape).get(dst, [])
    assert strict_rendezvous_completes(plans)


# ---- the simulator --------------------------------------------------------------------------------
@pytest.mark.parametrize("costs", [(1, 2), (1, 1), (2, 1), (0.3, 1.7)])
def test_bubble_formulas(costs):
    for schedule, p, m, v in layouts(ms=(1, 2, 3, 4, 8, 12, 16), ps=(1, 2, 3, 4, 8), vs=(1, 2, 3, 4)):
        if schedule.startswith("zb-"):
            continue  # test_zero_bubble_bubbles
        timeline = simulate_schedule(schedule, p, m, v, *costs)
        expected = (p - 1) / (m * v) if schedule == "interleaved" else (p - 1) / m
        assert abs(timeline.bubble_fraction - expected) < 1e-9, (schedule, p, m, v, costs)


def test_simulator_reports_deadlock():
    bad = [[Action(Op.BACKWARD, 0, 0), Action(Op.FORWARD, 0, 0)], [Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad, 1, 1)


def test_an_op_nobody_handles_fails_loudly():
    """A new kind of action must be handled everywhere Op is read:
    until it is, every reader raises instead of treating it as a forward or a backward."""

    class Future(Enum):
        W = "W"

    action = Action(Future.W, 0, 0)  # type: ignore[arg-type]
    for reader in (
        lambda: produced_message(action, 0, 2, 1),
        lambda: simulate([[action]], 1, 1),
        lambda: _last_backward_indices([action]),
    ):
        with pytest.raises(ValueError, match="not handled"):
            reader()


def test_strict_rendezvous_check_catches_crossed_sends():
    # Both ranks send first and receive later: under NCCL's worst case neither send can complete.
    from parallel.pipeline.p2p import Message, Step

    x, y = Message(Op.FORWARD, 0, 1), Message(Op.BACKWARD, 0, 0)
    crossed = [
        [Step((("send", 1, x),), 0), Step((("recv", 1, y),), None)],
        [Step((("send", 0, y),), 0), Step((("recv", 0, x),), None)],
    ]
    assert not strict_rendezvous_completes(crossed)


# ---- the executor's plan, with communication cost and overlap ------------------------------------------
def test_overlap_shortens_the_interleaved_timeline():
    """Interleaved p4 m8 v2, a message costs 0.2 x a chunk's forward: computing while batches are in flight
    (overlap_p2p_comm) finishes earlier; without communication cost it reaches the schedule's ideal."""
    lists = all_lists("interleaved", 4, 8, 2)
    comm = 0.2 * 1.0 / 2
    blocking = simulate(lists, 2, 8, 1.0, 2.0, comm=CommPlan(comm))
    overlapped = simulate(lists, 2, 8, 1.0, 2.0, comm=CommPlan(comm, overlap=True))
    assert overlapped.makespan < 0.9 * blocking.makespan
    ideal = simulate(lists, 2, 8, 1.0, 2.0)  # no plan: the schedule's own timeline
    assert simulate(lists, 2, 8, 1.0, 2.0, comm=CommPlan(overlap=True)).makespan == pytest.approx(ideal.makespan)
    assert simulate(lists, 2, 8, 1.0, 2.0, comm=CommPlan()).makespan > ideal.makespan  # rendezvous stalls


@pytest.mark.parametrize("schedule,p,m,v", list(layouts(ms=(1, 2, 4, 8), ps=(2, 3, 4), vs=(1, 2))))
def test_overlap_never_slower_and_every_action_runs_once(schedule, p, m, v):
    lists = all_lists(schedule, p, m, v)
    v_shape = uses_v_shape(schedule)
    for comm in (0.0, 0.1, 0.5):
        blocking = simulate(lists, v, m, v_shape=v_shape, comm=CommPlan(comm))
        overlapped = simulate(lists, v, m, v_shape=v_shape, comm=CommPlan(comm, overlap=True))
        assert overlapped.makespan <= blocking.makespan + 1e-9
        for timeline in (blocking, overlapped):
            for r in range(p):  # each rank runs its list, in order
                assert [e.action for e in timeline.events if e.rank == r] == lists[r]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [4, 8, 12, 16])
def test_zero_bubble_bubbles(p, m):
    """tF = tB = tW = 1 (a whole backward costs 2): ZB-H1's bubble is the paper's (p-1)(tF + tB - tW) per
    rank against 1F1B's (p-1)(tF + tB + tW); ZB-V's is at most ZB-H1's. Each rank holds at most 1F1B's
    peak of p micro-batches (a micro-batch is held until its WEIGHT)."""
    if m < p:
        pytest.skip("the formulas assume m >= p")
    costs = dict(forward_cost=1.0, backward_cost=2.0, weight_cost=1.0)
    one_f_one_b = simulate_schedule("1f1b", p, m, **costs)
    zb_h1 = simulate_schedule("zb-h1", p, m, **costs)
    zb_v = simulate_schedule("zb-v", p, m, 2, **costs)
    assert one_f_one_b.makespan - one_f_one_b.ideal == pytest.approx((p - 1) * (1 + 1 + 1))
    assert zb_h1.makespan - zb_h1.ideal == pytest.approx((p - 1) * (1 + 1 - 1))
    assert zb_v.makespan - zb_v.ideal <= zb_h1.makespan - zb_h1.ideal + 1e-9
    for schedule, v in (("zb-h1", 1), ("zb-v", 2)):
        assert max(max_held(build_schedule(schedule, p, r, m, v)) / v for r in range(p)) == p


def max_held(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) forwards held at once: until the WEIGHT (or whole BACKWARD)."""
    held = peak = 0
    for action in actions:
        held += {Op.FORWARD: 1, Op.BACKWARD_INPUT: 0, Op.BACKWARD: -1, Op.WEIGHT: -1}[action.op]
        peak = max(peak, held)
    return peak
