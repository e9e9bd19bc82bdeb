"""Host overhead of one optimizer step: LLaMA structure at tiny shapes, where compute is negligible.

    python -m benchmarks.overhead                    # 8 and 24 layers: single process, 2-rank FSDP2 and ZeRO-2
    python -m benchmarks.overhead --device cuda      # single process on a GPU (launch-bound there)
    python -m benchmarks.overhead --quick            # 2 layers, few steps, seconds

At hidden size 16 a step's FLOPs and bytes are nothing, so its time is what it costs to issue the work: Python,
the dispatcher and (on a GPU) kernel launches. That cost grows with the number of matrices unless the step is
executed in groups, which is what torch's foreach and fused AdamW do. Each optimizer's median step time is
reported with the number of aten ops the profiler records per step, and as a ratio to fused AdamW measured in
the same run (on the engines: to AdamW over the same engine's shards, the engine's own step excluded).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from typing import Any, Callable

import torch

from . import optimizers
from .cli import parse_args
from .launch import finish_worker, gather, init_worker, run_workers
from .results import fmt, markdown_table, write_results
from .timing import time_call

#: targets from the launch-count issue: host time per step over fused AdamW's (single process)
TARGETS = {"scale": 3.0, "dasgo": 3.0}
DEFAULT_TARGET = 10.0
#: on the 2-rank engines the same ratios must hold within this factor (against AdamW on the same engine)
ENGINE_SLACK = 1.5


def tiny_llama(layers: int, device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """LLaMA structure (7 matrices per block, embedding, LM head, norm gains) at hidden 16."""
    from shardopt.train.model import Llama, LlamaConfig

    torch.manual_seed(seed)
    with torch.device(device):
        return Llama(
            LlamaConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2, num_layers=layers, max_seq_len=16
            )
        )


def matrix_count(model: torch.nn.Module) -> int:
    return sum(1 for p in model.parameters() if p.dim() == 2)


def fill_grads(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        g = (torch.randn(local.shape, generator=gen) * 1e-3).to(device=local.device, dtype=local.dtype)
        p.grad = type(p).from_local(g, p.device_mesh, p.placements) if hasattr(p, "to_local") else g


def aten_ops(fn: Callable[[], object]) -> int:
    """aten ops the profiler records during one call (nested ones included, as the profiler lists them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def measure(step: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """Median host time of ``step`` (device work included: it is synchronized) and aten ops per step."""
    for _ in range(warmup):
        time_call(step, device)
    times = [time_call(step, device) for _ in range(repeats)]
    return {"median_s": statistics.median(times), "times_s": times, "aten_ops": aten_ops(step)}


def single_process(layers: int, names: list[str], device: torch.device, args: argparse.Namespace) -> list[dict]:
    records = []
    for name in names:
        model = tiny_llama(layers, device)
        fill_grads(model)
        try:
            opt = optimizers.build(name, model)
        except RuntimeError as exc:  # fused AdamW missing for a device
            records.append({"engine": "single", "layers": layers, "optimizer": name, "error": str(exc)[:80]})
            continue
        rec = measure(opt.step, device, args.warmup, args.repeats)
        records.append(
            {"engine": "single", "layers": layers, "matrices": matrix_count(model), "optimizer": name, **rec}
        )
        print(
            f"  single {layers:2d} layers {name:14s} {rec['median_s'] * 1e3:8.2f} ms {rec['aten_ops']:7d} ops",
            flush=True,
        )
        del opt, model
        gc.collect()
    base = next((r for r in records if r["optimizer"] == "adamw_fused" and "median_s" in r), None)
    if base is not None:  # the baseline again after the others: the faster of its two medians is the one used
        model = tiny_llama(layers, device)
        fill_grads(model)
        again = measure(optimizers.build("adamw_fused", model).step, device, args.warmup, args.repeats)
        base["medians_s"] = [base["median_s"], again["median_s"]]
        base["median_s"] = min(base["medians_s"])
    return ratios(records, "adamw_fused")


def ratios(records: list[dict], baseline: str) -> list[dict]:
    """Each record's time over ``baseline``'s on the same engine and depth (also without collectives, where
    measured). Targets: the single-process ones, times ``ENGINE_SLACK`` on the 2-rank engines."""
    base = {(r["engine"], r["layers"]): r for r in records if r["optimizer"] == baseline and "median_s" in r}
    for r in records:
        ref = base.get((r["engine"], r["layers"]))
        if "median_s" in r and ref:
            r["vs_adamw"] = r["median_s"] / ref["median_s"]
            if "net_s" in r and ref.get("net_s"):
                r["net_vs_adamw"] = r["net_s"] / ref["net_s"]
            r["baseline"] = baseline
            target = TARGETS.get(r["optimizer"], DEFAULT_TARGET) * (1 if r["engine"] == "single" else ENGINE_SLACK)
            r["target"] = None if r["optimizer"].startswith("adamw") else target
    return records


# ---- the 2-rank half: one process per rank under torch.distributed.run (gloo, CPU) ----

#: the torch.distributed calls whose time a step spends waiting on the other ranks
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "barrier",
)


class _CollectiveClock:
    """Times the collectives issued inside ``with clock:`` (torch.distributed's functions wrapped for the
    block): on 2 CPU ranks over gloo each costs a fixed latency that does not depend on the number of matrices,
    so the step's time is reported with and without it."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._saved = 0.0, 0, {}

    def __enter__(self) -> "_CollectiveClock":
        import time

        import torch.distributed as dist

        self.seconds, self.calls = 0.0, 0
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def timed(*args: Any, _fn=fn, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1

            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()


class _TimedStep:
    """Wraps an optimizer's ``step`` so the engine calls it as usual while we time (or profile) just that call:
    ZeRO attaches its flat gradient partitions inside its own step, so the optimizer must be reached through it.
    Each call's time in collectives is kept beside it (``_CollectiveClock``)."""

    def __init__(self, opt: Any) -> None:
        self.inner, self.seconds, self.ops, self.profile = opt.step, [], [], False
        self.collective_seconds: list[float] = []
        self.collective_calls: list[int] = []
        opt.step = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.profile:
            box: list[Any] = []
            self.ops.append(aten_ops(lambda: box.append(self.inner(*args, **kwargs))))
            return box[0]
        import time

        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            # the ranks enter together: a collective inside the step then costs its latency and the step's own
            # imbalance, not the skew the engine's forward and backward left between the ranks (which the
            # engine's next collective would absorb if the optimizer had none)
            dist.barrier()
        with _CollectiveClock() as clock:
            t0 = time.perf_counter()
            out = self.inner(*args, **kwargs)
            self.seconds.append(time.perf_counter() - t0)
        self.collective_seconds.append(clock.seconds)
        self.collective_calls.append(clock.calls)
        return out


def _engine_step(engine: str, model: torch.nn.Module, name: str) -> tuple[Callable[[], None], _TimedStep]:
    """(one engine step with fresh gradients, the timer around the optimizer's own step) for ``name`` on
    ``engine``; ``adamw`` is torch's AdamW (foreach) over the same shards."""
    import torch.distributed as dist

    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        else:
            import shardopt

            opt = shardopt.create_optimizer(model, name)
        timer = _TimedStep(opt)

        def fsdp_step() -> None:
            fill_grads(model, seed=dist.get_rank())
            opt.step()

        return fsdp_step, timer
    if engine != "zero2":
        raise SystemExit(f"--engines: unknown engine {engine!r}; choose from fsdp2, zero2")
    import deepspeed

    import shardopt.deepspeed as sds

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
    }
    if name == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        ds_engine, _, _, _ = deepspeed.initialize(model=model, optimizer=inner, config=config)
        timer = _TimedStep(ds_engine.optimizer.optimizer)
    else:
        ds_engine, _, _, _ = sds.initialize(model=model, config=config | {"shardopt": {"optimizer": name}})
        timer = _TimedStep(optimizers.shardopt_of(ds_engine.optimizer))
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(dist.get_rank()))

    def zero_step() -> None:
        ds_engine.backward(ds_engine(tokens[:, :-1], tokens[:, 1:]))
        ds_engine.step()

    return zero_step, timer


def allreduce_latency(repeats: int = 200) -> float:
    """Median seconds of a 16-float all-reduce between the ranks with nothing else running: the floor under
    every collective of a step (gloo on a CPU; a GPU interconnect's is tens of microseconds)."""
    import time

    import torch.distributed as dist

    x = torch.zeros(16)
    times = []
    for k in range(repeats + 20):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if k >= 20:
            times.append(time.perf_counter() - t0)
    return max(gather(statistics.median(times)))


def worker(args: argparse.Namespace) -> None:
    rank, world = init_worker()
    latency = allreduce_latency()
    records = []
    for layers in args.layer_list:
        for engine in [e for e in args.engines.split(",") if e]:
            for name in ["adamw"] + args.names:
                model = tiny_llama(layers)
                engine_step, timer = _engine_step(engine, model, name)
                times, net, calls = [], [], 0
                for k in range(args.warmup + args.repeats):
                    # an engine may call the optimizer more than once per step (DeepSpeed ZeRO steps each param
                    # group on its own): a step's time is the sum of its calls
                    first = len(timer.seconds)
                    engine_step()
                    if k >= args.warmup:
                        t = sum(timer.seconds[first:])
                        times.append(t)
                        net.append(t - sum(timer.collective_seconds[first:]))
                        calls = max(calls, sum(timer.collective_calls[first:]))
                timer.profile = True
                engine_step()
                slowest = max(gather(statistics.median(times)))  # a step ends when its slowest rank does
                slowest_net = max(gather(statistics.median(net)))
                records.append(
                    {
                        "engine": engine,
                        "layers": layers,
                        "matrices": matrix_count(model),
                        "optimizer": name,
                        "median_s": slowest,
                        "net_s": slowest_net,
                        "collectives": calls,
                        "aten_ops": sum(timer.ops),
                        "allreduce_s": latency,
                    }
                )
                if rank == 0:
                    print(
                        f"  {engine} {layers:2d} layers {name:8s} {slowest * 1e3:8.2f} ms "
                        f"({slowest_net * 1e3:.2f} ms without {calls} collectives) {sum(timer.ops):7d} ops",
                        flush=True,
                    )
                del model, engine_step, timer
                gc.collect()
    finish_worker(records, args.out)


def _verdict(r: dict, ratio: float | None) -> str:
    if not r.get("target") or ratio is None:
        return ""
    return f" ({'ok' if ratio <= r['target'] else 'over'} <= {r['target']:g}x)"


def latency_floors(records: list[dict]) -> list[str]:
    """Per 2-rank record whose wall clock is over its target: what its collectives cost at least, at the idle
    all-reduce latency, as a multiple of AdamW's whole step on that engine and depth (the wall clock cannot go
    below it while the collective schedule stays as it is)."""
    base = {(r["engine"], r["layers"]): r["median_s"] for r in records if r["optimizer"] == "adamw" and "median_s" in r}
    out = []
    for r in records:
        lat, ref = r.get("allreduce_s"), base.get((r["engine"], r["layers"]))
        if r.get("collectives") and lat and ref and r.get("target") and r.get("vs_adamw", 0) > r["target"]:
            floor = r["collectives"] * lat
            out.append(
                f"{r['optimizer']} on {r['engine']}, {r['layers']} layers: {r['collectives']} "
                f"collective{'s' if r['collectives'] != 1 else ''} "
                f">= {floor * 1e3:.2f} ms = {floor / ref:.1f}x AdamW's step (wall {r['vs_adamw']:.1f}x)"
            )
    return out


def to_markdown(records: list[dict]) -> str:
    out = []
    for engine in dict.fromkeys(r["engine"] for r in records):
        rows = []
        layers_seen = list(dict.fromkeys(r["layers"] for r in records if r["engine"] == engine))
        names = list(dict.fromkeys(r["optimizer"] for r in records if r["engine"] == engine))
        with_net = any("net_s" in r for r in records if r["engine"] == engine)
        for name in names:
            row: list[Any] = [name]
            for layers in layers_seen:
                r = next(
                    (r for r in records if (r["engine"], r["layers"], r["optimizer"]) == (engine, layers, name)), {}
                )
                if "median_s" not in r:
                    row += [r.get("error", ""), "", ""]
                    continue
                if with_net:  # the verdict on host time; the wall clock, collectives included, beside it
                    host_ratio = r.get("net_vs_adamw")
                    row += [
                        fmt(r.get("net_s", 0) * 1e3, ".2f"),
                        fmt(host_ratio, ".1f") + _verdict(r, host_ratio),
                        fmt(r["median_s"] * 1e3, ".2f"),
                        fmt(r.get("vs_adamw"), ".1f"),
                        str(r.get("collectives", "")),
                    ]
                else:
                    row += [
                        fmt(r["median_s"] * 1e3, ".2f"),
                        fmt(r.get("vs_adamw"), ".1f") + _verdict(r, r.get("vs_adamw")),
                    ]
                row.append(str(r["aten_ops"]))
            rows.append(row)
        headers = ["optimizer"]
        for layers in layers_seen:
            m = next(r.get("matrices") for r in records if r["engine"] == engine and r["layers"] == layers)
            if with_net:
                headers += [f"{layers} layers ({m} matrices): host ms", "/ AdamW", "wall ms", "/ AdamW", "collectives"]
            else:
                headers += [f"{layers} layers ({m} matrices): ms", "/ AdamW"]
            headers.append("aten ops")
        base = "fused AdamW" if engine == "single" else "AdamW (foreach) on the same shards"
        out.append(f"\n## {engine} (ratios to {base})\n\n" + markdown_table(headers, rows))
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="8,24", help="comma list of depths")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--optimizers", default=None, help="comma list of shardopt names (default: all registered)")
    ap.add_argument("--repeats", type=int, default=15, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--engines", default="fsdp2,zero2", help="2-rank engines ('' for none; CPU only)")
    ap.add_argument("--out", default=None, help="result file stem (default overhead, or overhead_cuda)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--names", default="", help=argparse.SUPPRESS)
    args = parse_args(ap, argv, dict(layers="2", repeats=3, warmup=1))
    args.layer_list = [int(x) for x in str(args.layers).split(",") if x]
    names = optimizers.select(args.optimizers, optimizers.registered())
    if args.worker:
        args.names = [n for n in args.names.split(",") if n]
        worker(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    records: list[dict] = []
    for layers in args.layer_list:
        records += single_process(layers, list(optimizers.ADAMW_VARIANTS) + names, device, args)
    engines = [e for e in args.engines.split(",") if e] if args.device == "cpu" else []
    if engines:
        dist_records = run_workers(
            "benchmarks.overhead",
            2,
            [
                "--layers",
                str(args.layers),
                "--repeats",
                str(args.repeats),
                "--warmup",
                str(args.warmup),
                "--engines",
                ",".join(engines),
                "--names",
                ",".join(names),
            ],
        )
        records += ratios(dist_records, "adamw")
    notes = [
        "Host time per step = wall time of optimizer.step() with the device synchronized, median of the timed "
        "steps, at hidden 16 (compute negligible). Ratios are to fused AdamW in the same run (single process) "
        "or to torch AdamW (foreach) stepping the same engine's shards (2 ranks, gloo, slowest rank).",
        "aten ops: events named aten::* that torch.profiler records during one step, nested ops included.",
        "Single process, fused AdamW is measured first and again last; the lower of its two medians is the "
        "baseline (a slow moment of the machine can only make the ratios larger).",
        "2-rank engines: the ratio with the verdict is of host time per step, as the issue's criterion reads "
        "(the same ratios within 1.5x: targets are the single-process ones x1.5): the slowest rank's wall time "
        "of its optimizer calls minus the time spent inside their collectives (gloo latency and waiting for "
        "the other rank). The wall time, collectives included, is beside it. 'collectives' is the number of "
        "torch.distributed calls per step (bucketed: it does not grow with the number of matrices). The ranks "
        "pass a barrier (not timed) before each optimizer call, so a step is not charged for the skew the "
        "engine's backward left between them.",
        "Refresh-based optimizers (SUMO, Alice) are reported by their median step, i.e. between refreshes.",
    ]
    latency = next((r["allreduce_s"] for r in records if "allreduce_s" in r), None)
    if latency is not None:
        floors = latency_floors(records)
        notes.append(
            f"One 16-float all-reduce between the 2 ranks with nothing else running took {latency * 1e3:.2f} ms "
            "(median); inside a step, where the ranks reach it at different times, a collective costs more. "
            "The collective schedule is fixed (the issue keeps it as it is), so the wall clock cannot go "
            "below the collectives' count times that latency" + (": " + "; ".join(floors) + "." if floors else ".")
        )
    path = write_results(
        args.out or ("overhead" if args.device == "cpu" else "overhead_cuda"),
        {k: v for k, v in vars(args).items() if k not in ("worker", "names")},
        records,
        to_markdown(records),
        notes,
        device=args.device,
        out_dir=args.results_dir,
    )
    print(to_markdown(records))
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main(sys.argv[1:])
