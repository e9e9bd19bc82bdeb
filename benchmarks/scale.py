"""Scale simulation: every optimizer's optimizer state per rank, plan-building time, traffic and whole-matrix
FLOPs at simulated world sizes up to 1024, on LLaMA 1B and 7B shapes (issue 15, part 4).

    python -m benchmarks.scale            # 1b and 7b; P = 8, 64, 256, 1024; FSDP2, ZeRO-1/2, ZeRO-3
    python -m benchmarks.scale --quick    # 1b; P = 8, 64; a few optimizers (runs/benchmarks/quick/)

One process acts as rank 0 of P through torch's fake process group (``FakeStore``, backend ``"fake"``; its
collectives do nothing), re-initialized for every P. Models are built on the meta device, so nothing is
allocated: the plans depend only on the layouts (shapes and every rank's pieces), which every rank derives
identically, so this one process knows every rank's plan.

* Layouts. ``fsdp2``: ``fully_shard`` on every block and the root over a 1-D mesh of P ranks (``Shard(0)``
  row chunks; the meta parameters' local shards are never materialized, the plans need only their shapes).
  ``zero1/2`` and ``zero3``: DeepSpeed ZeRO's flat fp32 partitions from ``shardopt.plugin.zero_layouts``, the
  functions the DeepSpeed adapter maps a live engine with (checked against DeepSpeed 0.19 at simulated world
  sizes by ``tests/test_scale_plans.py``), attached to the optimizer as DeepSpeed's wrapper does (ZeRO-1 and
  ZeRO-2 partition the optimizer state identically). Default hyperparameters (SUMO/Alice rank 128).
* State per rank: ``ShardedOptimizer.planned_state_elements(r)`` (fp32 elements kept after a step, from the
  static plans; a test checks it against real allocations) for every rank r, computed here for all P ranks at
  once from the same plans and cross-checked against ``planned_state_elements(r)`` itself on rank 0, the
  busiest rank, the last rank and random ranks (every rank when P <= 64). "single" is the same optimizer on the
  unsharded model (whole layouts). The bound (issue 15): busiest <= 1.15 x single / P + 16 MiB; it applies to
  ``auto`` and ``distributed`` and to the optimizers without whole-matrix work; ``gather`` is reported.
  AdamW: torch AdamW's two moments over each rank's local elements in the same layout (ZeRO: the padded
  flat partition it would step).
* Plan building: optimizer construction + layouts (ZeRO: the fragments) + ``matrix_plan`` of every group
  (Muon's included: its Newton-Schulz runs on the cached plan like every whole-matrix optimizer).
* Traffic per step, estimated from the plans (bytes summed over all ranks, shown per rank = sum / P):
  gather = each gathered matrix to its owner and back (2 x 4 B x the elements not already on the owner);
  realign = rows moved to fill the distributed strategy's row blocks and back (2 x 4 B x sum of
  ``RowPlan.sent``); allreduce = the reduced partial sums (a ring all-reduce: 2 (P-1) x 4 B x reduced
  elements); state = the split small state of distributed matrices all-gathered for the step ((P-1) x 4 B x
  its elements; SUMO's and Alice's bases rest with their rows and are not gathered: ``state_split.ROWS``).
  These are a step between refreshes; "at a refresh" is what a refresh step adds (SUMO's range finder and
  ``Q_new^T Q``, Alice's switch: ``OpCost.refresh_reduced``, a ring all-reduce where the rows are split).
  The per-row/column statistics of SCALE/SinkGD/RACS/DASGO are not estimated here (``comm``).
* FLOPs (whole-matrix work, per step): a rank computes ``row_flops`` x its share of A's rows for every
  distributed matrix and ``small_flops`` for those whose factorization it owns (or for every one, where the
  optimizer repeats it on every rank), and everything for the matrices it owns under gather.
* Modeled seconds (issue 27): the same plans under ``--profile`` (``shardopt.sharding.time_model``), busiest
  rank, against a forward+backward of 6 x params x max(4096, 4M / P) tokens at 40% of 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import random
import time
from typing import Any

import torch

from shardopt.sharding.state_split import rows_aligned

from . import optimizers
from .cli import parse_args
from .results import fmt, markdown_table, write_results

MIB = 1 << 20
#: issue 15: busiest rank's state <= BOUND_FACTOR x single-process state / P + BOUND_SLACK bytes
BOUND_FACTOR = 1.15
BOUND_SLACK = 16 * MIB
#: issue 27: modeled optimizer seconds per step <= TIME_TARGET x the reference forward+backward
TIME_TARGET = 0.10
VOCAB = 32000
LAYOUTS = ("fsdp2", "zero1/2", "zero3")
STRATEGIES = ("auto", "distributed", "gather", "team")
WORLDS = "8,64,256,1024"


# ---------------------------------------------------------------------------------------------- world
def init_world(world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def close_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def meta_model(size: str) -> torch.nn.Module:
    from .models import MOE_PRESETS, build_llama, build_moe

    if size in MOE_PRESETS:  # fused 3-D experts: each expert a matrix of the rule (issue 46)
        return build_moe(size, VOCAB, device="meta")
    return build_llama(size, VOCAB, device="meta")


def fsdp2_model(size: str, world: int) -> torch.nn.Module:
    """FSDP2 row shards on a 1-D mesh of ``world`` fake ranks (meta parameters: shapes only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = meta_model(size)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def whole_matrix(name: str) -> bool:
    from shardopt.optim.registry import OPTIMIZERS

    return bool(OPTIMIZERS[name].whole_matrix_work)


def _groups(opt: Any) -> list[dict]:
    return opt._groups() if hasattr(opt, "_groups") else opt.param_groups


def build_plans(opt: Any) -> None:
    for g in range(len(_groups(opt))):
        opt.matrix_plan(g)


def attach_zero(opt: Any, shapes: dict[str, tuple[int, ...]], world: int, stage: str) -> torch.Tensor:
    """Replace each param group's parameters by ZeRO flat fp32 partitions of rank 0 (meta tensors) with their
    fragments, as DeepSpeed's wrapper and ``attach_zero_layouts`` do; AdamW's per-rank elements (padded)."""
    import torch.distributed as dist

    from shardopt.plugin.zero_layouts import zero3_fragments, zero3_partition_numel, zero3_sub_groups, zero12_fragments

    group = dist.group.WORLD
    local = 0
    attached = []
    for g, pg in enumerate(_groups(opt)):
        names = list(opt.group_param_names[g])
        if not names:
            continue
        flats = []
        if stage == "zero1/2":
            frags, part = zero12_fragments(names, [shapes[n] for n in names], world, 0, group)
            flats.append((torch.empty(part, device="meta"), frags))
        else:
            parts = [zero3_partition_numel(math.prod(shapes[n]), world) for n in names]
            for idx in zero3_sub_groups(parts):
                sub = [names[i] for i in idx]
                frags, length = zero3_fragments(sub, [shapes[n] for n in sub], world, 0, group)
                flats.append((torch.empty(length, device="meta"), frags))
        attached.extend(flats)
        local += sum(flat.numel() for flat, _ in flats)
        pg["params"] = [f for f, _ in flats] if stage == "zero1/2" else []  # ZeRO-3 empties them between steps
    opt.use_layouts(flat=attached)
    return torch.full((world,), 2 * local, dtype=torch.int64)


def build(layout: str, model: torch.nn.Module, name: str, kw: dict, world: int) -> tuple[Any, float, torch.Tensor]:
    """The optimizer on ``layout`` with every plan built: (optimizer, seconds, AdamW elements per rank)."""
    import shardopt

    if layout == "fsdp2":
        t0 = time.perf_counter()
        opt = shardopt.create_optimizer(model, name, **kw)
        build_plans(opt)
        seconds = time.perf_counter() - t0
        adamw = torch.zeros(world, dtype=torch.int64)
        for p in model.parameters():
            for frag in opt.fragments(p):  # a batched parameter (fused experts) is several matrices
                adamw += 2 * piece_numels(frag.layout)
        return opt, seconds, adamw
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    t0 = time.perf_counter()
    opt = shardopt.create_optimizer(model, name, **kw)
    adamw = attach_zero(opt, shapes, world, layout)
    build_plans(opt)
    return opt, time.perf_counter() - t0, adamw


# ---------------------------------------------------------------------------------------------- per rank
def piece_numels(lay: Any) -> torch.Tensor:
    return torch.tensor([lay._piece_numel(p) for p in lay.pieces], dtype=torch.int64)


def share_numels(place: Any, spec: dict, world: int) -> torch.Tensor:
    """``state_split.share_numel(place, spec, r)`` for every rank r at once (the same integer arithmetic:
    whole on the owner under gather, the row plan's cut for ``ROWS`` state, ``torch.chunk`` cuts otherwise)."""
    out = torch.zeros(world, dtype=torch.int64)
    ranks = torch.arange(world, dtype=torch.int64)
    for shape, dim in spec.values():
        if dim is None:
            out += math.prod(shape)
            continue
        other = math.prod(s for d, s in enumerate(shape) if d != dim)
        length = shape[dim]
        if place.owner is not None:
            out[place.owner] += length * other
            continue
        if rows_aligned(dim) and place.row_starts is not None and place.row_starts[-1] == length:
            out += torch.tensor(place.row_starts, dtype=torch.int64).diff() * other  # with the rows (ROWS)
            continue
        if place.members is not None:  # a team: even over its members
            g = len(place.members)
            c = -(-length // g) if length else 0
            for j, r in enumerate(place.members):
                out[r] += (min((j + 1) * c, length) - min(j * c, length)) * other
            continue
        if place.world == 1:
            out += length * other
            continue
        c = -(-length // world) if length else 0
        lo, hi = (ranks * c).clamp(max=length), ((ranks + 1) * c).clamp(max=length)
        out += (hi - lo) * other
    return out


def per_rank_state(opt: Any, world: int) -> dict[str, torch.Tensor]:
    """``planned_state_elements(r)`` for every rank r (int64 tensors of ``world`` entries, by kind)."""
    groups = _groups(opt)
    out = {k: torch.zeros(world, dtype=torch.int64) for k in ("elements", "vectors", "matrix")}
    for g, frags in opt._fragments_by_group(all_groups=True).items():
        group = groups[g]
        copies = opt.elementwise_state_copies(group)
        ops = opt.matrix_plan(g)
        index = {n: i for i, n in enumerate(ops.names)} if ops is not None else {}
        for f in frags:
            lay = f.layout
            if copies:
                out["elements"] += copies * piece_numels(lay)
            out["vectors"] += opt.vector_state(group, lay.shape)
            if f.name in index:
                i = index[f.name]
                out["matrix"] += share_numels(
                    ops.placements[i], opt.matrix_state_spec(group, ops.plans[i].a_shape), world
                )
    return out


def check_ranks(opt: Any, state: dict[str, torch.Tensor], world: int, busiest: int, samples: int) -> list[int]:
    """Compare the vectorized per-rank state with ``planned_state_elements(r)`` (every rank up to 64)."""
    rng = random.Random(world)
    ranks = list(range(world)) if world <= 64 else sorted({0, busiest, world - 1, *rng.sample(range(world), samples)})
    for r in ranks:
        want = opt.planned_state_elements(r)
        got = {k: int(v[r]) for k, v in state.items()}
        if got != want:
            raise AssertionError(f"rank {r}: per-rank state {got} differs from planned_state_elements {want}")
    return ranks


def traffic_and_flops(opt: Any, world: int) -> tuple[dict[str, float], torch.Tensor, dict[str, int]]:
    """Traffic of a step between refreshes (fp32 elements summed over ranks, by kind) and, under ``refresh``,
    what a refresh step adds (SUMO's new bases, Alice's switches: ``OpCost.refresh_reduced`` all-reduced where
    the rows are split); whole-matrix FLOPs per rank; strategies."""
    traffic = {"gather": 0.0, "realign": 0.0, "allreduce": 0.0, "state": 0.0, "refresh": 0.0}
    flops = torch.zeros(world, dtype=torch.float64)
    kinds: dict[str, int] = {}
    groups = _groups(opt)
    for g, group in enumerate(groups):
        ops = opt.matrix_plan(g)
        if ops is not None:
            spec_of = functools.partial(_state_spec, opt, group)
            _add_costs(ops, world, traffic, flops, kinds, spec_of)
    return traffic, flops, kinds


def _state_spec(opt: Any, group: Any, plan: Any) -> Any:
    return opt.matrix_state_spec(group, plan.a_shape)


def _add_costs(
    ops: Any, world: int, traffic: dict[str, float], flops: torch.Tensor, kinds: dict[str, int], spec_of: Any
) -> None:
    for i, (kind, plan, owner, factor_owner) in enumerate(zip(ops.kinds, ops.plans, ops.owners, ops.factor_owners)):
        c = ops.cost_of(i)
        kinds[kind] = kinds.get(kind, 0) + 1
        work = (c.row_flops, c.small_flops + c.small_matmul)
        if kind == "local":
            flops += work[0] + work[1]
            continue
        sent = sum(plan.sent)
        if kind == "gather":
            traffic["gather"] += 2 * sent
            flops[owner] += work[0] + work[1]
            continue
        if kind == "team":  # the matrix to its members and back; reductions and state among the members
            g = len(ops.teams[i])
            traffic["gather"] += 2 * sent
            traffic["allreduce"] += 2 * (g - 1) * (c.reduced + c.shared)
            traffic["refresh"] += 2 * (g - 1) * c.refresh_reduced
            spec = spec_of(plan)
            traffic["state"] += (g - 1) * _moving(spec)
            starts = torch.tensor(plan.starts, dtype=torch.float64)
            flops += work[0] * (starts[1:] - starts[:-1]) / max(plan.a_shape[0], 1)
            if c.shared:
                flops[factor_owner] += work[1]
            else:
                flops[list(ops.teams[i])] += work[1]
            continue
        traffic["realign"] += 2 * sent
        traffic["allreduce"] += 2 * (world - 1) * c.reduced
        traffic["refresh"] += 2 * (world - 1) * c.refresh_reduced
        spec = spec_of(plan)
        traffic["state"] += (world - 1) * _moving(spec)
        starts = torch.tensor(plan.starts, dtype=torch.float64)
        flops += work[0] * (starts[1:] - starts[:-1]) / max(plan.a_shape[0], 1)
        if c.shared:  # computed once, by its factorization owner (MatrixOps.compute_once)
            flops[factor_owner] += work[1]
        else:
            flops += work[1]


def _moving(spec: dict) -> int:
    """Elements of one matrix's split state that a step with split rows gathers (all but ``ROWS`` state)."""
    return sum(math.prod(s) for s, d in spec.values() if d is not None and not rows_aligned(d))


#: the issue-27 reference step: forward+backward at 40% MFU of 989 TFLOP/s on max(4096, 4M / P) tokens per rank
FWD_BWD_MFU = 0.4 * 989e12
#: line-statistic all-reduce rounds per step of the element-wise rules (SCALE/DASGO 1, SinkGD/RACS 5 sweeps of
#: rows and columns); whole-matrix rules' line rounds are in their plans
LINE_ROUNDS = {"scale": 1, "dasgo": 1, "sinkgd": 10, "racs": 10, "swan": 2}


def fwd_bwd_seconds(n_params: int, world: int) -> float:
    return 6.0 * n_params * max(4096, (4 << 20) / world) / FWD_BWD_MFU


def modeled_time(opt: Any, world: int, name: str, default_profile: str = "gpu") -> dict[str, Any]:
    """The optimizer's modeled seconds per step on every rank (issue 27), under its plans' profile:
    whole-matrix work (``MatrixOps.op_cost``: FLOPs by kind, bytes, rounds), element-wise passes (compulsory
    memory traffic of ``costmodel.traffic_elements`` over each rank's elements) and line-statistic all-reduces
    ((m + n) per matrix per round). Reports the busiest rank's seconds and bytes (sent + received)."""
    from shardopt.sharding.time_model import resolve_profile

    from .costmodel import traffic_elements

    groups = _groups(opt)
    profile = None
    seconds = torch.zeros(world, dtype=torch.float64)
    net = torch.zeros(world, dtype=torch.float64)  # bytes sent + received
    mem = torch.zeros(world, dtype=torch.float64)
    line = 0.0
    kinds: dict[str, float] = {}  # strategy -> collective rounds per step (bucketed: the most of its matrices)
    for g, frags in opt._fragments_by_group(all_groups=True).items():
        group = groups[g]
        rule = group.get("treatment", "adamw")
        ops = opt.matrix_plan(g)
        if ops is not None:
            profile = ops.profile
            for i, kind in enumerate(ops.kinds):
                # a group inside one node moves over the node's links (issue 53: two-level profiles)
                bw = ops.profile.intra_bandwidth if ops._group_on_node(i) else ops.profile.bandwidth
                if kind == "team":  # holders send their pieces and get results; members per the plan
                    sent_el = torch.tensor(ops.plans[i].sent, dtype=torch.float64)
                    out_b, in_b = 4 * ops.cost_of(i).channels * sent_el, 4 * sent_el
                    seconds += torch.maximum(out_b, in_b) / bw
                    net += out_b + in_b
                    for r in ops.teams[i]:
                        own = ops._team_cost(i, len(ops.teams[i]), ops.factor_owners[i] == r, rank=r)
                        own.rounds = 0.0
                        seconds[r] += own.seconds(ops.profile) - float(torch.maximum(out_b[r], in_b[r])) / bw
                        net[r] += (
                            own.sent + own.received + own.node_sent + own.node_received - float(out_b[r] + in_b[r])
                        )
                elif kind == "gather":
                    pieces = piece_numels(ops.plans[i].layout).double() * 4
                    own = ops.op_cost(i, "gather")
                    seconds += pieces / bw
                    net += 2 * pieces
                    seconds[ops.owners[i]] += own.seconds(ops.profile) - float(pieces[ops.owners[i]]) / bw
                    net[ops.owners[i]] += (
                        own.sent + own.received + own.node_sent + own.node_received - 2 * float(pieces[ops.owners[i]])
                    )
                else:  # every rank its rows; a shared factorization on its factorization owner only
                    c = ops.op_cost(i, kind, owner=kind == "local")
                    c.rounds = 0.0
                    seconds += c.seconds(ops.profile)
                    net += c.sent + c.received + c.node_sent + c.node_received
                    split = ops.cost_of(i)
                    if kind == "distributed" and split.shared:
                        seconds[ops.factor_owners[i]] += ops.profile.seconds(
                            split.small_matmul, split.small_flops, calls=split.small_calls
                        )
                if kind != "local" and (ops.plans[i].layout.holders > 1 or kind != "gather"):
                    rounds = 2.0 if kind == "gather" else ops.cost_of(i).split_rounds()
                    kinds[kind] = max(kinds.get(kind, 0.0), rounds)
        rule_name = "adamw" if rule == "adamw" else name
        for f in frags:
            m, n = f.layout.shape
            per = traffic_elements(rule_name, m, n, group) or 0.0
            mem += per / max(m * n, 1) * piece_numels(f.layout).double() * 4
            if rule != "adamw" and f.layout.group is not None:
                line += (m + n) * LINE_ROUNDS.get(name, 0)
    if profile is None:  # no whole-matrix plan: the optimizer's configured profile, for meta tensors
        profile = resolve_profile(default_profile)
    seconds += mem / profile.memory_bandwidth
    ring = 2.0 * (world - 1) / world
    one_node = profile.within_node(range(world))  # line statistics reduce over the whole group
    bw, lat = (profile.intra_bandwidth, profile.intra_latency) if one_node else (profile.bandwidth, profile.latency)
    seconds += ring * 4 * line / bw + LINE_ROUNDS.get(name, 0) * lat
    net += 2 * ring * 4 * line
    seconds += lat * sum(kinds.values())
    busiest = int(seconds.argmax())
    return {
        "modeled_s": float(seconds[busiest]),
        "modeled_rank": busiest,
        "traffic_busiest_bytes": float(net.max()),
        "modeled_mean_s": float(seconds.mean()),
        "profile": profile.describe(),
    }


def busiest_transient(opt: Any, world: int) -> float | None:
    """The largest per-rank whole-matrix transient of a step (elements), if the optimizer can tell it: every
    owner of a gathered matrix, and one rank that owns none (all such ranks hold the same)."""
    if not hasattr(opt, "planned_transient_elements"):
        return None
    owners = set()
    for g in range(len(_groups(opt))):
        ops = opt.matrix_plan(g)
        if ops is not None:
            owners |= {o for k, o in zip(ops.kinds, ops.owners) if k == "gather"}
            owners |= {r for k, t in zip(ops.kinds, ops.teams) if k == "team" for r in t}
    others = [r for r in range(min(world, len(owners) + 1)) if r not in owners][:1]
    return max(float(opt.planned_transient_elements(r)) for r in sorted(owners) + others)


# ---------------------------------------------------------------------------------------------- one case
def largest_owned_bytes(opt: Any, rank: int) -> int:
    """The largest whole-matrix small state (bytes) of one matrix that ``rank`` owns (gathers) in any group: what
    any owner-compute scheme must hold, and issue 27's allowance beside the even share."""
    groups = _groups(opt)
    best = 0
    for g in range(len(groups)):
        ops = opt.matrix_plan(g)
        if ops is None:
            continue
        for kind, owner, plan, team in zip(ops.kinds, ops.owners, ops.plans, ops.teams):
            if (kind == "gather" and owner == rank) or (kind == "team" and rank in team):
                spec = opt.matrix_state_spec(groups[g], plan.a_shape)
                whole = 4 * sum(math.prod(s) for s, d in spec.values() if d is not None)
                best = max(best, whole if kind == "gather" else whole / len(team))
    return best


def run_case(
    model_size: str,
    layout: str,
    world: int,
    model: torch.nn.Module,
    name: str,
    strategy: str | None,
    single_bytes: int,
    n_params: int,
    samples: int,
    profile: str = "gpu",
    hyperparameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    kw = {**(hyperparameters or {}), **({"matrix_ops": {"strategy": strategy, "profile": profile}} if strategy else {})}
    opt, plan_s, adamw = build(layout, model, name, kw, world)
    state = per_rank_state(opt, world)
    total = 4 * (state["elements"] + state["vectors"] + state["matrix"])
    busiest = int(total.argmax())
    checked = check_ranks(opt, state, world, busiest, samples)
    traffic, flops, kinds = traffic_and_flops(opt, world)
    per_step = sum(v for k, v in traffic.items() if k != "refresh")
    transient = busiest_transient(opt, world)
    owned = largest_owned_bytes(opt, busiest)
    bound = BOUND_FACTOR * single_bytes / world + owned + BOUND_SLACK
    timing = modeled_time(opt, world, name, profile)
    fwd_bwd = fwd_bwd_seconds(n_params, world)
    rec = {
        "model": model_size,
        "layout": layout,
        "world_size": world,
        "optimizer": name,
        "strategy": strategy or "-",
        **({"hyperparameters": hyperparameters} if hyperparameters else {}),
        "params": n_params,
        "single_bytes": single_bytes,
        "busiest_bytes": int(total[busiest]),
        "busiest_rank": busiest,
        "mean_bytes": float(total.double().mean()),
        "rank0_bytes": int(total[0]),
        "min_bytes": int(total.min()),
        "sum_over_single": float(total.sum()) / single_bytes,
        "busiest_by_kind": {k: 4 * int(v[busiest]) for k, v in state.items()},
        "adamw_busiest_bytes": 4 * int(adamw.max()),
        "vs_adamw": float(total[busiest]) / (4 * int(adamw.max())),
        "bound_bytes": bound,
        "within_bound": int(total[busiest]) <= bound,
        "bound_applies": strategy in (None, "auto", "distributed", "team"),
        "plan_s": plan_s,
        "strategies": kinds,
        "traffic_bytes": {k: 4 * v for k, v in traffic.items() if k != "refresh"},
        "traffic_per_rank_bytes": 4 * per_step / world,
        "traffic_vs_grad": (4 * per_step / world) / (4 * n_params),
        "refresh_extra_bytes": 4 * traffic["refresh"],
        "busiest_flops": float(flops.max()),
        "mean_flops": float(flops.mean()),
        "transient_busiest_bytes": 4 * transient if transient is not None else None,
        "checked_ranks": len(checked),
        "largest_owned_bytes": owned,
        **timing,
        "fwd_bwd_s": fwd_bwd,
        "time_ratio": timing["modeled_s"] / fwd_bwd,
        "within_time": timing["modeled_s"] <= TIME_TARGET * fwd_bwd,
    }
    del opt
    return rec


def single_state(model: torch.nn.Module, name: str, hyperparameters: dict[str, Any] | None = None) -> int:
    import shardopt

    opt = shardopt.create_optimizer(model, name, **(hyperparameters or {}))
    return 4 * sum(opt.planned_state_elements().values())


def cases(names: list[str], strategies: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for name in names:
        if whole_matrix(name):
            out += [(name, s) for s in strategies]
        else:
            out.append((name, None))
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = optimizers.select(args.optimizers, optimizers.registered())
    todo = cases(names, args.strategies.split(","))
    records = []
    for size in args.models.split(","):
        plain = meta_model(size)
        # forward+backward scales with what a token runs through (an MoE's active experts)
        n_params = getattr(plain, "active_params", None) or sum(p.numel() for p in plain.parameters())
        init_world(1)
        singles = {name: single_state(plain, name, args.hyperparameters.get(name)) for name in names}
        worlds = args.worlds_7b if size == "7b" and args.worlds_7b else args.worlds
        if size == "7b" and not args.worlds_7b and args.worlds == WORLDS:
            worlds = WORLDS + ",4096"
        for world in (int(w) for w in worlds.split(",")):
            init_world(world)
            for layout in args.layouts.split(","):
                model = fsdp2_model(size, world) if layout == "fsdp2" else meta_model(size)
                for name, strategy in todo:
                    t0 = time.perf_counter()
                    try:
                        rec = run_case(
                            size,
                            layout,
                            world,
                            model,
                            name,
                            strategy,
                            singles[name],
                            n_params,
                            args.check_ranks,
                            args.profile,
                            args.hyperparameters.get(name),
                        )
                    except Exception as err:  # a failing case is reported, the others still run
                        import traceback

                        traceback.print_exc()
                        rec = {
                            "model": size,
                            "layout": layout,
                            "world_size": world,
                            "optimizer": name,
                            "strategy": strategy or "-",
                            "error": f"{type(err).__name__}: {err}",
                        }
                    records.append(rec)
                    gc.collect()
                    if "error" not in rec:
                        print(
                            f"{size} {layout:8s} P={world:5d} {name:7s} {rec['strategy']:11s} busiest "
                            f"{rec['busiest_bytes'] / MIB:9.1f} MiB bound {rec['bound_bytes'] / MIB:9.1f} "
                            f"{'ok ' if rec['within_bound'] else 'OVER'} time {rec['time_ratio']:6.3f}x fwd+bwd "
                            f"{'ok ' if rec['within_time'] else 'SLOW'} plan {rec['plan_s']:6.2f} s "
                            f"({time.perf_counter() - t0:.1f} s)",
                            flush=True,
                        )
                del model
        close_world()
    return records


# ---------------------------------------------------------------------------------------------- tables
def _label(r: dict) -> str:
    hp = ",".join(f"{k}={v}" for k, v in r.get("hyperparameters", {}).items())
    name = f"{r['optimizer']}[{hp}]" if hp else r["optimizer"]
    return name if r["strategy"] == "-" else f"{name} ({r['strategy']})"


def parse_hyperparameters(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--set swan:whitening=svd`` (repeatable) -> ``{"swan": {"whitening": "svd"}}``; values are JSON where
    they parse as JSON (numbers, booleans), else strings."""
    import json

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not (sep and eq and name and key):
            raise SystemExit(f"--set {item!r}: expected OPTIMIZER:KEY=VALUE, e.g. swan:whitening=svd")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(name.strip().lower(), {})[key.strip()] = parsed
    return out


def to_markdown(records: list[dict[str, Any]]) -> str:
    ok = [r for r in records if "error" not in r]
    out = []
    for size in dict.fromkeys(r["model"] for r in records):
        rs = [r for r in ok if r["model"] == size]
        cols = list(dict.fromkeys((r["layout"], r["world_size"]) for r in rs))
        labels = list(dict.fromkeys(_label(r) for r in rs))
        cell = {(_label(r), r["layout"], r["world_size"]): r for r in rs}

        def ratio(r: dict | None) -> str:
            if r is None:
                return "error"
            s = f"{r['busiest_bytes'] / r['bound_bytes']:.2f}"
            return s if r["within_bound"] else (f"**{s}**" if r["bound_applies"] else f"({s})")

        out.append(
            f"\n## {size}: busiest rank's state / bound (1.15 x single / P + largest owned matrix's state + 16 MiB)\n\n"
            "Above 1 misses the bound: **bold** where the bound applies (auto, distributed, optimizers "
            "without whole-matrix work), (parenthesized) under gather, which the bound does not cover.\n\n"
        )
        out.append(
            markdown_table(
                ["optimizer (strategy)", *[f"{lay} P={w}" for lay, w in cols]],
                [[lab, *[ratio(cell.get((lab, lay, w))) for lay, w in cols]] for lab in labels],
            )
        )

        def timing(r: dict | None) -> str:
            if r is None:
                return "error"
            s = f"{r['time_ratio']:.3f}"
            return s if r["within_time"] else (f"**{s}**" if r["strategy"] in ("-", "auto") else f"({s})")

        out.append(
            f"\n## {size}: modeled optimizer seconds / forward+backward (issue 27; target <= {TIME_TARGET})\n\n"
            f"Busiest rank under the `{ok[0].get('profile', '?') if ok else '?'}` profile; forward+backward = "
            "6 x params x max(4096, 4M / P) tokens at 40% of 989 TFLOP/s. **Bold**: over target under auto "
            "(or an optimizer without whole-matrix work); (parenthesized): over under a forced strategy.\n\n"
        )
        out.append(
            markdown_table(
                ["optimizer (strategy)", *[f"{lay} P={w}" for lay, w in cols]],
                [[lab, *[timing(cell.get((lab, lay, w))) for lay, w in cols]] for lab in labels],
            )
        )
        worlds = list(dict.fromkeys(w for _, w in cols))
        out.append(f"\n## {size}: plan building (s; construction + layouts + every group's plan), slowest layout\n\n")
        rows = []
        for lab in labels:
            row = [lab]
            for w in worlds:
                t = [cell[(lab, lay, w)]["plan_s"] for lay, ww in cols if ww == w and (lab, lay, w) in cell]
                row.append(fmt(max(t), ".2f") if t else "")
            rows.append(row)
        out.append(markdown_table(["optimizer (strategy)", *[f"P={w}" for w in worlds]], rows))
        out.append(
            f"\n## {size}: every case\n\nMiB per rank; AdamW = torch AdamW's busiest rank in the same layout; "
            "traffic = estimated bytes sent per step between refreshes per rank (sum over ranks / P) by kind, "
            "and their sum over the fp32 gradient; at a refresh = what a refresh step adds (SUMO's new bases, "
            "Alice's switches: reductions where the rows are split; every K steps); FLOPs = busiest rank's "
            "whole-matrix work per step; transient = busiest rank's largest bucket of whole-matrix transients.\n\n"
        )
        rows = []
        for r in rs:
            t = r["traffic_bytes"]
            rows.append(
                [
                    r["layout"],
                    str(r["world_size"]),
                    _label(r),
                    fmt(r["busiest_bytes"] / MIB, ".1f"),
                    fmt(r["mean_bytes"] / MIB, ".1f"),
                    fmt(r["rank0_bytes"] / MIB, ".1f"),
                    fmt(r["adamw_busiest_bytes"] / MIB, ".1f"),
                    fmt(r["vs_adamw"], ".3f"),
                    fmt(r["single_bytes"] / r["world_size"] / MIB, ".1f"),
                    fmt(r["bound_bytes"] / MIB, ".1f"),
                    "yes" if r["within_bound"] else ("NO" if r["bound_applies"] else "no (gather)"),
                    fmt(r["plan_s"], ".2f") + (f" (+{r['step_plan_s']:.2f}/step)" if r.get("step_plan_s") else ""),
                    " / ".join(
                        fmt(t[k] / r["world_size"] / MIB, ".1f") for k in ("gather", "realign", "allreduce", "state")
                    ),
                    fmt(r.get("refresh_extra_bytes", 0.0) / r["world_size"] / MIB, ".1f"),
                    fmt(r["traffic_vs_grad"], ".2f"),
                    fmt(r["traffic_busiest_bytes"] / MIB, ".1f"),
                    fmt(1e3 * r["modeled_s"], ".2f"),
                    fmt(r["time_ratio"], ".3f"),
                    fmt(r["busiest_flops"] / 1e9, ".1f"),
                    fmt(
                        r["transient_busiest_bytes"] / MIB if r["transient_busiest_bytes"] is not None else None, ".0f"
                    ),
                ]
            )
        out.append(
            markdown_table(
                [
                    "layout",
                    "P",
                    "optimizer (strategy)",
                    "busiest",
                    "mean",
                    "rank 0",
                    "AdamW",
                    "busiest / AdamW",
                    "single / P",
                    "bound",
                    "within",
                    "plan s",
                    "traffic MiB/rank: gather / realign / allreduce / state",
                    "at a refresh: + MiB/rank",
                    "traffic / grad",
                    "busiest rank MiB sent+received",
                    "modeled ms",
                    "/ fwd+bwd",
                    "GFLOP busiest",
                    "transient MiB",
                ],
                rows,
            )
        )
    errors = [r for r in records if "error" in r]
    if errors:
        out.append(
            "\n## errors\n\n"
            + markdown_table(
                ["model", "layout", "P", "optimizer (strategy)", "error"],
                [[r["model"], r["layout"], str(r["world_size"]), _label(r), r["error"]] for r in errors],
            )
        )
    return "".join(out)


def notes_for(records: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in records if "error" not in r]
    miss = [r for r in ok if r["bound_applies"] and not r["within_bound"]]
    gather_miss = [r for r in ok if not r["bound_applies"] and not r["within_bound"]]
    slowest = max(ok, key=lambda r: r["plan_s"], default=None)
    slow = [r for r in ok if r["strategy"] in ("-", "auto") and not r["within_time"]]
    worst = {}
    for r in ok:
        if r["strategy"] in ("-", "auto"):
            key = r["optimizer"]
            if key not in worst or r["time_ratio"] > worst[key]["time_ratio"]:
                worst[key] = r
    time_note = (
        f"modeled optimizer time <= {TIME_TARGET} x forward+backward under auto: "
        + ("met in every case" if not slow else f"MISSED in {len(slow)} case(s)")
        + "; worst per optimizer: "
        + ", ".join(
            f"{k} {r['time_ratio']:.3f} ({r['model']} {r['layout']} P={r['world_size']})" for k, r in worst.items()
        )
    )
    notes = [
        time_note,
        f"bound (auto, distributed, optimizers without whole-matrix work): "
        f"{'met in every case' if not miss else f'MISSED in {len(miss)} case(s)'}"
        + "".join(
            f"; {r['model']} {r['layout']} P={r['world_size']} {_label(r)}: busiest (rank "
            f"{r['busiest_rank']}) {r['busiest_bytes'] / MIB:.1f} MiB (small matrix state "
            f"{r['busiest_by_kind']['matrix'] / MIB:.1f}, elementwise {r['busiest_by_kind']['elements'] / MIB:.1f})"
            f" > bound {r['bound_bytes'] / MIB:.1f} MiB, mean {r['mean_bytes'] / MIB:.1f} MiB, strategies "
            f"{r['strategies']}"
            for r in miss[:10]
        ),
        f"gather above the bound in {len(gather_miss)} of {sum(not r['bound_applies'] for r in ok)} case(s) "
        "(one matrix's state cannot be split under gather).",
    ]
    if slowest is not None:
        notes.append(
            f"slowest plan building: {slowest['plan_s']:.2f} s ({slowest['model']} {slowest['layout']} "
            f"P={slowest['world_size']} {_label(slowest)})."
        )
    notes.append(
        "per-rank state of every rank computed from the plans and checked against "
        "planned_state_elements(r) on the ranks listed in 'checked_ranks' (all ranks when P <= 64)."
    )
    return notes


def merge_records(records: list[dict[str, Any]], out: str, results_dir: Any) -> tuple[list[dict[str, Any]], str]:
    """``records`` in place of the same optimizers' records of ``<out>.json`` (the others kept, in their order;
    each keeps the commit it was measured at), and a note saying which are which."""
    from .results import environment, read_results

    old = read_results(out, results_dir)
    if old is None:
        raise SystemExit(f"--merge: no {out}.json in {results_dir} to merge into")
    commit = environment("cpu")["commit"]
    for r in records:
        r.setdefault("commit", commit)

    def case(r: dict) -> tuple:
        return r["model"], r["layout"], r["world_size"], r["optimizer"]

    new = {case(r) for r in records}
    kept = [r for r in old["records"] if case(r) not in new]
    for r in kept:
        r.setdefault("commit", old["environment"]["commit"])
    by_case: dict[tuple, list] = {}
    for r in kept + records:
        by_case.setdefault(case(r), []).append(r)
    merged = [
        r for c in dict.fromkeys([case(r) for r in old["records"]] + [case(r) for r in records]) for r in by_case[c]
    ]
    names = sorted({r["optimizer"] for r in records})
    commits = sorted({r["commit"] for r in kept} - {commit})
    return merged, (
        f"merged (--merge): {len(records)} records of {', '.join(names)} measured at commit {commit}; "
        f"the other {len(kept)} kept from {out}.json (commit {', '.join(commits) or commit}), whose plans "
        "the change did not move"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="1b,7b,moe-8x1b",
        help="model presets (shardopt.train.model.PRESETS, benchmarks.models.MOE_PRESETS)",
    )
    ap.add_argument("--worlds", default=WORLDS, help="simulated world sizes")
    ap.add_argument(
        "--worlds-7b",
        default=None,
        help=f"simulated world sizes of the 7b model (default: --worlds, and 4096 with the default {WORLDS})",
    )
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {LAYOUTS}")
    ap.add_argument("--optimizers", default=None, help="comma list of shardopt names (default: all registered)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="whole-matrix strategies to run")
    ap.add_argument(
        "--check-ranks",
        type=int,
        default=4,
        help="random ranks (beyond 0, the busiest and the last) checked against planned_state_elements",
    )
    ap.add_argument("--profile", default="gpu", help="matrix_ops.profile of the modeled seconds (gpu, cpu)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTIMIZER:KEY=VALUE",
        help="a hyperparameter of one optimizer (repeatable), e.g. swan:whitening=svd; labelled in the tables",
    )
    ap.add_argument("--out", default="scale", help="result file stem")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the other optimizers' records of an existing <out>.json and replace only those run "
        "now (after a change that moves only their plans; the notes say which records are new)",
    )
    args = parse_args(ap, argv, dict(models="1b", worlds="8,64", optimizers="scale,muon,sumo,alice"))
    args.hyperparameters = parse_hyperparameters(args.set)
    for lay in args.layouts.split(","):
        if lay not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown {lay!r}; choose from {LAYOUTS}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    records = run(args)
    notes = [f"whole run: {time.perf_counter() - t0:.0f} s"]
    if args.merge:
        records, merged = merge_records(records, args.out, args.results_dir)
        notes.insert(0, merged)
    notes = notes_for(records) + notes
    path = write_results(args.out, dict(vars(args)), records, to_markdown(records), notes, out_dir=args.results_dir)
    print("\n".join(notes))
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
