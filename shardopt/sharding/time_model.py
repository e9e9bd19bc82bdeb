"""Modeled seconds of a whole-matrix step: what ``strategy="auto"`` minimizes (issue 27).

A strategy's cost is counted for the busiest rank in three units a profile turns into seconds: FLOPs by
kind (products with the matrix, which split with its rows; small factorizations: eigh, SVD, QR,
Newton-Schulz on ``k x k`` matrices), bytes the rank sends or receives in collectives (links are full
duplex: the larger of the two counts), and collective rounds (latency). Memory is a budget, not the
objective (``MatrixOps`` checks it); a step's modeled time is what the plan minimizes.

The profile is named in ``matrix_ops.profile``:

* ``"gpu"``: an H100-class cluster node, its rates from the project's measured kernels
  (``benchmarks/results/factorizations_cuda.md``, H100, torch 2.11): products at 50 TFLOP/s (fp32 products of
  768-1024 wide matrices measured 45-52 TFLOP/s; the iterative routes' float64 products are taken at the same
  rate, unmeasured); factorizations at the slowest measured kind's rate and per-call latency, since cuSOLVER
  runs them one matrix at a time: SVD 0.14 TFLOP/s marginal with 2.8 ms per call (eigh 1.0-1.2 TFLOP/s and
  1.6 ms, QR 0.67 TFLOP/s and 0.6 ms); 25 GB/s of collective bandwidth per rank, 20 us per collective round,
  2 TB/s of device memory bandwidth for element-wise passes; two levels of links (issue 53): 8 ranks per node
  joined by NVLink 4 (H100 SXM: 900 GB/s bidirectional, 450 GB/s per direction per GPU; taken at 360 GB/s of
  bus bandwidth, 80% of the link rate, what NCCL's ring all-gathers reach, and 10 us per round) and 25 GB/s per
  rank with 20 us per round across nodes (``docs/time-model.md`` sources each figure). On CUDA the whole-matrix
  rules take the iterative routes (``sharding.iterative``): their costs count products between refreshes and the
  factorizations a refresh runs, amortized over its interval (``OpCost.small_calls``).
* ``"cpu"``: this project's CPU test machine, measured with one thread per process: fp32 matmul 60 GFLOP/s,
  float64 eigh of 64-512 wide matrices 8-30 GFLOP/s (10 k^3 counted; 10 GFLOP/s taken), gloo all-reduce
  between two local processes 1.2 GB/s per rank and 0.3 ms per round (inside a node and across alike), 5 GB/s
  memory bandwidth.
* ``"auto"`` (default): ``"cpu"`` where the parameters live on the CPU, ``"gpu"`` elsewhere (CUDA, meta).
* or numbers: ``{"matmul_tflops": .., "factor_tflops": .., "factor_latency_us": .., "bandwidth_gbs": ..,
  "latency_us": .., "memory_gbs": .., "ranks_per_node": .., "node_bandwidth_gbs": .., "node_latency_us": ..}``
  (missing keys from ``"gpu"``; ``bandwidth_gbs`` and ``latency_us`` are the links between nodes).

Ranks per node: ``ranks_per_node`` where given, else ``LOCAL_WORLD_SIZE`` (torchrun's processes per node; it
numbers ranks node by node, so ranks ``[b n, (b + 1) n)`` share node ``b``), else the profile's default (``gpu``:
8; ``cpu``: 0, every rank on one node). A collective among ranks of one node costs the node's links, any other
the links between nodes. Every rank resolves the same profile from the same config (torchrun gives every node
the same ``LOCAL_WORLD_SIZE``), so plans stay identical on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

__all__ = ["HardwareProfile", "PROFILES", "resolve_profile", "StepCost"]


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of one rank: FLOP/s of matrix products and of small factorizations, seconds per factorization call
    (a GPU's solvers run one matrix at a time, so a 128 x 128 ``eigh`` costs 1.6 ms whatever its FLOPs),
    collective bytes/s and seconds per round between nodes (``bandwidth``, ``latency``) and inside one
    (``node_bandwidth``, ``node_latency``; 0: the same as between nodes), ranks per node (0: all ranks on one
    node), and device memory bytes/s (element-wise passes)."""

    matmul_flops: float
    factor_flops: float
    bandwidth: float
    latency: float
    memory_bandwidth: float
    factor_latency: float = 0.0
    ranks_per_node: int = 0
    node_bandwidth: float = 0.0
    node_latency: float = 0.0

    def seconds(
        self,
        matmul: float = 0.0,
        factor: float = 0.0,
        net_bytes: float = 0.0,
        rounds: float = 0.0,
        mem_bytes: float = 0.0,
        calls: float = 0.0,
        node_bytes: float = 0.0,
        node_rounds: float = 0.0,
    ) -> float:
        """``net_bytes`` / ``rounds`` cross the links between nodes, ``node_bytes`` / ``node_rounds`` stay in one."""
        return (
            matmul / self.matmul_flops
            + factor / self.factor_flops
            + calls * self.factor_latency
            + net_bytes / self.bandwidth
            + rounds * self.latency
            + mem_bytes / self.memory_bandwidth
            + node_bytes / self.intra_bandwidth
            + node_rounds * self.intra_latency
        )

    @property
    def intra_bandwidth(self) -> float:
        return self.node_bandwidth or self.bandwidth

    @property
    def intra_latency(self) -> float:
        return self.node_latency or self.latency

    def within_node(self, ranks: "tuple[int, ...] | range") -> bool:
        """Whether ranks (of the default group, numbered node by node) all lie on one node."""
        n = self.ranks_per_node
        return not ranks or n <= 0 or min(ranks) // n == max(ranks) // n

    def describe(self) -> str:
        node = (
            f"; {self.ranks_per_node} ranks per node, {self.intra_bandwidth / 1e9:g} GB/s and "
            f"{self.intra_latency * 1e6:g} us per round inside one"
            if self.ranks_per_node > 0
            else ""
        )
        return (
            f"matmul {self.matmul_flops / 1e12:g} TFLOP/s, factorizations {self.factor_flops / 1e12:g} TFLOP/s "
            f"and {self.factor_latency * 1e3:g} ms per call, "
            f"collectives {self.bandwidth / 1e9:g} GB/s and {self.latency * 1e6:g} us per round{node}, memory "
            f"{self.memory_bandwidth / 1e9:g} GB/s"
        )


PROFILES: dict[str, HardwareProfile] = {
    "gpu": HardwareProfile(
        matmul_flops=50e12,
        factor_flops=0.14e12,
        bandwidth=25e9,
        latency=20e-6,
        memory_bandwidth=2e12,
        factor_latency=2.8e-3,
        ranks_per_node=8,
        node_bandwidth=360e9,
        node_latency=10e-6,
    ),
    "cpu": HardwareProfile(matmul_flops=60e9, factor_flops=10e9, bandwidth=1.2e9, latency=3e-4, memory_bandwidth=5e9),
}

#: user units of the numeric form -> (field, scale to SI)
_UNITS = {
    "matmul_tflops": ("matmul_flops", 1e12),
    "factor_tflops": ("factor_flops", 1e12),
    "factor_latency_us": ("factor_latency", 1e-6),
    "bandwidth_gbs": ("bandwidth", 1e9),
    "latency_us": ("latency", 1e-6),
    "memory_gbs": ("memory_bandwidth", 1e9),
    "node_bandwidth_gbs": ("node_bandwidth", 1e9),
    "node_latency_us": ("node_latency", 1e-6),
    "ranks_per_node": ("ranks_per_node", 1),
}


def _local_world_size() -> int | None:
    """torchrun's processes per node (``LOCAL_WORLD_SIZE``), if set and a positive integer."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _with_node(profile: HardwareProfile, explicit: bool = False) -> HardwareProfile:
    """``profile`` with ``LOCAL_WORLD_SIZE`` as its ranks per node, unless given explicitly."""
    n = None if explicit else _local_world_size()
    return profile if n is None or n == profile.ranks_per_node else replace(profile, ranks_per_node=n)


def resolve_profile(spec: Any, device_type: str | None = None) -> HardwareProfile:
    """``spec``: a profile name, ``"auto"`` (by ``device_type``), a mapping in the user units of ``_UNITS``, or a
    ``HardwareProfile``. Errors name the key ``matrix_ops.profile``."""
    if isinstance(spec, HardwareProfile):
        return spec
    if spec is None or spec == "auto":
        return _with_node(PROFILES["cpu" if device_type == "cpu" else "gpu"])
    if isinstance(spec, str):
        if spec not in PROFILES:
            raise ValueError(
                f"matrix_ops.profile: unknown profile {spec!r}; use 'auto', one of {sorted(PROFILES)}, "
                f"or numbers {sorted(_UNITS)}"
            )
        return _with_node(PROFILES[spec])
    if isinstance(spec, Mapping):
        base = PROFILES[str(spec.get("base", "gpu"))] if spec.get("base", "gpu") in PROFILES else None
        if base is None:
            raise ValueError(f"matrix_ops.profile.base must be one of {sorted(PROFILES)}, got {spec.get('base')!r}")
        values: dict[str, Any] = {}
        for key, value in spec.items():
            if key == "base" or value is None:
                continue
            if key not in _UNITS:
                raise ValueError(f"matrix_ops.profile.{key}: unknown key; use {sorted(_UNITS)}")
            if key == "ranks_per_node":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"matrix_ops.profile.ranks_per_node must be an integer >= 0 (0: every rank on "
                        f"one node), got {value!r}"
                    )
                values["ranks_per_node"] = value
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value == float("inf"):
                raise ValueError(f"matrix_ops.profile.{key} must be a positive finite number, got {value!r}")
            field, scale = _UNITS[key]
            values[field] = float(value) * scale
        return _with_node(replace(base, **values), explicit="ranks_per_node" in values)
    raise ValueError(f"matrix_ops.profile must be a name or a mapping, got {type(spec).__name__}")


@dataclass
class StepCost:
    """One rank's modeled work of a step (or of one matrix): FLOPs by kind, collective bytes and rounds between
    nodes (``sent``, ``received``, ``rounds``) and inside one (``node_sent``, ``node_received``, ``node_rounds``)."""

    matmul: float = 0.0
    factor: float = 0.0
    sent: float = 0.0
    received: float = 0.0
    rounds: float = 0.0
    #: factorization calls (each pays the profile's ``factor_latency``)
    calls: float = 0.0
    node_sent: float = 0.0
    node_received: float = 0.0
    node_rounds: float = 0.0

    def __iadd__(self, other: "StepCost") -> "StepCost":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @property
    def net_bytes(self) -> float:
        return max(self.sent, self.received)

    @property
    def node_bytes(self) -> float:
        return max(self.node_sent, self.node_received)

    def seconds(self, profile: HardwareProfile) -> float:
        return profile.seconds(
            self.matmul,
            self.factor,
            self.net_bytes,
            self.rounds,
            calls=self.calls,
            node_bytes=self.node_bytes,
            node_rounds=self.node_rounds,
        )

    def on_node(self) -> "StepCost":
        """The same work with its collectives inside one node (a group that lies within a node)."""
        return replace(
            self,
            sent=0.0,
            received=0.0,
            rounds=0.0,
            node_sent=self.node_sent + self.sent,
            node_received=self.node_received + self.received,
            node_rounds=self.node_rounds + self.rounds,
        )
