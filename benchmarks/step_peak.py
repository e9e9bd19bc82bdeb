"""The peak memory of a whole training step, as a single-GPU or offload fine-tuner feels it (issue 62).

    python -m benchmarks.step_peak                   # LLaMA-350M, every case, one fresh process each
    python -m benchmarks.step_peak --cases adamw,scale,scale+bwd,scale+bwd+bf16
    python -m benchmarks.step_peak --quick           # the tiny preset
    python -m benchmarks.step_peak --malloc live     # freed memory returned at once: the peak of live tensors
    python -m benchmarks.step_peak --cases scale+bwd+bf16 --update   # rerun some cases, keep the file's others

Each case runs in a fresh process (one at a time): build the model (bf16 cases build it in bf16, so no fp32 copy
ever exists), then two steps of one 127-token sequence, and report the process's peak resident memory
(``ru_maxrss``: it includes Python, torch, the weights, activations, gradients and optimizer state). Cases:
``fwd+bwd`` (no optimizer), ``adamw`` (``torch.optim.AdamW``), ``<rule>`` (``create_optimizer``'s ordinary step),
``<rule>+bwd`` (``step_in_backward=True``), ``<rule>+bwd+bf16`` (bf16 weights, no fp32 master,
``bf16_updates="stochastic"``). The modeled 7B lines count weights, the gradients alive at once, the optimizer
state (``planned_state_elements`` of the optimizer built on the 7B shapes on the meta device) and the fp32 copy of
one group that bf16 stochastic rounding steps through; activations and the allocator's slack are not modeled.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Any

import torch

from .cli import parse_args
from .results import environment, fmt, markdown_table, read_results, write_results

RULES = ("scale", "sinkgd", "racs", "swan", "asgo", "dasgo", "sumo", "alice", "alice0", "muon")
CASES = (
    ["fwd+bwd", "fwd+bwd+bf16", "adamw"]
    + list(RULES)
    + [f"{r}+bwd" for r in RULES]
    + ["scale+bwd+bf16", "sinkgd+bwd+bf16", "racs+bwd+bf16", "muon+bwd+bf16"]
)
BUDGETS_GB = (24, 80)
SEQ = 127


def _worker(case: str, preset: str, steps: int) -> dict[str, Any]:
    import shardopt

    from .models import GALORE_VOCAB, build_llama

    parts = case.split("+")
    rule, in_backward, bf16 = parts[0], "bwd" in parts, "bf16" in parts
    if bf16:
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of the weights ever exists
    model = build_llama(preset)
    torch.set_default_dtype(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, GALORE_VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    opt: Any = None
    if rule == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif rule != "fwd":
        kw: dict[str, Any] = dict(lr=1e-4)
        if in_backward:
            kw["step_in_backward"] = True
        if bf16:
            kw["bf16_updates"] = "stochastic"
        opt = shardopt.create_optimizer(model, rule, **kw)
    losses = []
    for _ in range(steps):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[0, 1:])
        loss.backward()
        del logits
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"case": case, "peak_bytes": peak, "params": n_params, "losses": losses}


#: ``--malloc live``: glibc returns every freed block above this many bytes to the system at once, so the peak RSS
#: follows the live tensors (as CUDA's ``max_memory_allocated`` does) instead of what the heap kept for reuse
LIVE_MMAP_THRESHOLD = 131072


def _run_case(case: str, preset: str, steps: int, malloc: str = "default") -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if malloc == "live":
        env["MALLOC_MMAP_THRESHOLD_"] = str(LIVE_MMAP_THRESHOLD)
    cmd = [sys.executable, "-m", "benchmarks.step_peak", "--worker", case, "--preset", preset, "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"case": case, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _updated(previous: dict[str, Any] | None, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with the previous file's records of the other cases, in ``CASES``' order."""
    new = {r["case"]: r for r in records}
    kept = [r for r in (previous or {}).get("records", []) if "case" in r and r["case"] not in new]
    env = (previous or {}).get("environment", {})
    for r in kept:  # records written before they named their own commit: the file's
        r.setdefault("measured", f"{env.get('commit', '?')} {env.get('date', '?')}")
    merged = kept + records
    order = {c: i for i, c in enumerate(CASES)}
    return sorted(merged, key=lambda r: order.get(r["case"], len(order)))


def _provenance(records: list[dict[str, Any]]) -> str:
    """Which cases were measured at which commit and time (``--update`` keeps older records)."""
    when = dict.fromkeys(r.get("measured", "?") for r in records)
    return "measured at (commit, time): " + "; ".join(
        f"{w}: {', '.join(r['case'] for r in records if r.get('measured', '?') == w)}" for w in when
    )


def modeled_7b(rules: tuple[str, ...] = RULES) -> list[dict[str, Any]]:
    """Bytes of weights, gradients alive at once and optimizer state at 7B (meta device, no memory used)."""
    import shardopt

    from .models import build_llama

    model = build_llama("7b", device="meta")
    n = sum(p.numel() for p in model.parameters())
    largest_group = max(
        p.numel() for name, p in model.named_parameters() if "layers." not in name
    )  # the embedding / LM head: larger than one layer's matrices together
    layer = sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers.0."))
    alive = max(largest_group, layer)
    rows = [{"case": "adamw", "weights": 4 * n, "grads": 4 * n, "state": 8 * n, "copy": 0}]
    for rule in rules:
        state = 4 * sum(shardopt.create_optimizer(model, rule, lr=1e-4).planned_state_elements().values())
        rows.append({"case": rule, "weights": 4 * n, "grads": 4 * n, "state": state, "copy": 0})
        rows.append({"case": f"{rule}+bwd", "weights": 4 * n, "grads": 4 * alive, "state": state, "copy": 0})
        rows.append(
            {"case": f"{rule}+bwd+bf16", "weights": 2 * n, "grads": 2 * alive, "state": state, "copy": 8 * alive}
        )
    for r in rows:
        r["params"] = n
        r["total"] = r["weights"] + r["grads"] + r["state"] + r["copy"]
        for gb in BUDGETS_GB:
            r[f"fits_{gb}gb"] = r["total"] <= 0.9 * gb * 1e9
    return rows


def report(records: list[dict[str, Any]], model7b: list[dict[str, Any]], preset: str) -> str:
    base = next((r["peak_bytes"] for r in records if r["case"] == "adamw" and "peak_bytes" in r), None)
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["case"], "error", "", "", ""])
            continue
        ratio = r["peak_bytes"] / base if base else None
        rows.append(
            [r["case"], fmt(r["peak_bytes"] / 1e9, ".3g"), fmt(r["peak_bytes"] / r["params"], ".3g"), fmt(ratio, ".2f")]
        )
    out = [f"## Peak resident memory of a step, LLaMA-{preset}, one {SEQ}-token sequence, 2 steps\n"]
    out.append(markdown_table(["case", "peak RSS (GB)", "bytes / parameter", "x AdamW"], rows))
    out.append("\n## Modeled 7B (weights + gradients alive + optimizer state + bf16 rounding's fp32 copy)\n")
    rows7 = [
        [
            r["case"],
            fmt(r["weights"] / 1e9, ".3g"),
            fmt(r["grads"] / 1e9, ".3g"),
            fmt(r["state"] / 1e9, ".3g"),
            fmt(r["copy"] / 1e9, ".3g"),
            fmt(r["total"] / 1e9, ".3g"),
            "yes" if r["fits_24gb"] else "no",
            "yes" if r["fits_80gb"] else "no",
        ]
        for r in model7b
    ]
    head7 = ["case", "weights GB", "gradients GB", "state GB", "fp32 copy GB", "total GB", "fits 24 GB", "fits 80 GB"]
    out.append(markdown_table(head7, rows7))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (see the module docstring)")
    ap.add_argument("--preset", default="350m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--malloc",
        choices=("default", "live"),
        default="default",
        help="default: glibc as it is (freed memory stays in the heap for reuse); live: MALLOC_MMAP_THRESHOLD_="
        f"{LIVE_MMAP_THRESHOLD}, so the peak RSS follows the live tensors; results go to step_peak_live.*",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    if "--worker" in (argv if argv is not None else sys.argv[1:]):
        args = ap.parse_args(argv)
        print(json.dumps(_worker(args.worker, args.preset, args.steps)))
        return
    ap.add_argument(
        "--update",
        action="store_true",
        help="keep the results file's records of the cases not in --cases (each record names the commit and time it "
        "was measured at), so a change that touches some cases reruns only those",
    )
    args = parse_args(ap, argv, quick={"preset": "tiny", "cases": "fwd+bwd,adamw,scale,scale+bwd,scale+bwd+bf16"})
    name = "step_peak" if args.malloc == "default" else "step_peak_live"
    env = environment()
    records = []
    for case in args.cases.split(","):
        rec = _run_case(case, args.preset, args.steps, args.malloc)
        rec["measured"] = f"{env['commit']} {env['date']}"
        print(json.dumps({k: v for k, v in rec.items() if k != "losses"}), flush=True)
        records.append(rec)
    if args.update:
        records = _updated(read_results(name, args.results_dir), records)
    model7b = modeled_7b()
    md = report(records, model7b, args.preset)
    write_results(
        name,
        {"preset": args.preset, "steps": args.steps, "seq": SEQ, "cases": args.cases.split(","), "malloc": args.malloc},
        records + [{"modeled_7b": r} for r in model7b],
        md,
        notes=[
            "peak RSS of a fresh process per case (ru_maxrss), CPU, OMP_NUM_THREADS=1; cases run one at a time; "
            + (
                "glibc's default allocator (freed memory stays in the heap for reuse)"
                if args.malloc == "default"
                else f"MALLOC_MMAP_THRESHOLD_={LIVE_MMAP_THRESHOLD}: the peak follows the live tensors"
            ),
            "7B lines are modeled, not measured: activations and allocator slack excluded; "
            "fits = total <= 0.9 x budget",
            _provenance(records),
        ],
        out_dir=args.results_dir,
    )
    print(md)


if __name__ == "__main__":
    main()
