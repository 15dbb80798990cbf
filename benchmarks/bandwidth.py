"""Memory read bandwidth: the denominator of the memory-bound limit of a decode step.

Usage (also `gpt-jax bench bandwidth [flags]`; writes benchmarks/results/bandwidth.json):
  python benchmarks/bandwidth.py                 # 10 reads, the threads XLA's pool uses
  python benchmarks/bandwidth.py --reads 20 --threads 1

`BandwidthProbe` is what `speed.py throughput` and `roofline` time beside our decode, in the
same rounds. Its method is STREAM's (McCalpin 1995, "Memory Bandwidth and Machine Balance in
Current High Performance Computers"; STREAM times each kernel NTIMES and reports the rate of
the best time): the best of several timed reads is the machine's bandwidth, and slower reads
are reads that something else disturbed (other processes, page faults, frequency changes),
not a lower bandwidth. The best is the strictest bound for our step to be measured against:
a weaker probe would flatter it. The spread of the reads (best, median, worst) is reported
beside it, so a reader sees how settled the figure was.

Each read times two read kernels over the same `BANDWIDTH_BYTES` of float32 (far larger
than the caches; in 2 MB pages, as the engine's weights are: `gpt_jax.huge_pages`) and keeps
the faster, so neither kernel's own limits lower the figure:
  "xla":     a jitted `jnp.sum`, run by XLA:CPU as the engine's programs are;
  "threads": `numpy` sums of 1/n of the array in each of n Python threads (numpy's loops
             release the GIL), n the engine's thread count: XLA:CPU's intra-op pool has one
             thread per CPU this process may run on (`engine_threads`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

BANDWIDTH_BYTES = 1 << 29  # a float32 array far larger than the caches
KERNELS = ("xla", "threads")


def engine_threads() -> int:
    """The threads of XLA:CPU's intra-op pool, which runs the engine's dots and kernels: one
    per CPU this process may run on."""
    return len(os.sched_getaffinity(0))


class BandwidthProbe:
    """Times memory reads of `BANDWIDTH_BYTES` and keeps every read's rate, in GB/s.

    `read()` times one read of each kernel (see the module docstring) and returns the
    seconds of the faster, to time in turn with the engines; `best_gbs()` is the bound's
    bandwidth, `spread()` what the reads were. The first call of each kernel (compiling,
    faulting the pages in) is made here, untimed.

    Raises:
      ValueError: `threads` below 1.
    """

    def __init__(self, threads: int | None = None):
        import jax
        import jax.numpy as jnp

        from gpt_jax.huge_pages import pack

        self.threads = engine_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        # In 2 MB pages, as `LLM` and `Engine` hold the weights (`gpt_jax.huge_pages`): in
        # 4 KB pages the probe would read slower than the decode step it bounds.
        self._array = pack(jnp.ones((BANDWIDTH_BYTES // 4,), jnp.float32))
        self._sum = jax.jit(jnp.sum)
        self._parts = np.array_split(np.asarray(self._array), self.threads)  # the same memory
        self._seconds_xla(), self._seconds_threads()  # untimed first runs
        self.restart()

    def _seconds_xla(self) -> float:
        start = time.perf_counter()
        self._sum(self._array).block_until_ready()
        return time.perf_counter() - start

    def _seconds_threads(self) -> float:
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in self._parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return time.perf_counter() - start

    def read(self) -> float:
        """Time one read of each kernel; the seconds of the faster (both rates are kept)."""
        seconds = {"xla": self._seconds_xla(), "threads": self._seconds_threads()}
        for kernel, s in seconds.items():
            self.reads[kernel].append(BANDWIDTH_BYTES / s / 1e9)
        return min(seconds.values())

    def restart(self) -> None:
        """Forget the reads so far (a new measurement's rounds)."""
        self.reads = {kernel: [] for kernel in KERNELS}

    def best_gbs(self) -> float:
        """The best rate of every read so far, GB/s: the machine's bandwidth (STREAM's
        best-time rule). Raises ValueError before any `read()`."""
        rates = [r for kernel in KERNELS for r in self.reads[kernel]]
        if not rates:
            raise ValueError("no read yet: call read() first")
        return max(rates)

    def spread(self) -> dict:
        """GB/s of the reads, rounded to 0.1: the best over both kernels (`bandwidth_GBs`),
        the numpy kernel's thread count, and per kernel its best, median and worst."""
        out = {"bandwidth_GBs": round(self.best_gbs(), 1), "n_threads": self.threads}
        for kernel, rates in self.reads.items():
            out[kernel] = {"best": round(max(rates), 1),
                           "median": round(float(np.median(rates)), 1),
                           "worst": round(min(rates), 1), "reads": len(rates)}
        return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench bandwidth",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--reads", type=int, default=10, help="reads of each kernel")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of the numpy kernel (default: the engine's, "
                        "one per CPU this process may run on)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from speed import RESULTS, machine

    load = os.getloadavg()
    probe = BandwidthProbe(args.threads)
    for _ in range(args.reads):
        probe.read()
    spread = probe.spread()
    print(f"bandwidth {spread['bandwidth_GBs']} GB/s (best of {args.reads} reads of each "
          f"kernel, {probe.threads} threads); load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    for kernel in KERNELS:
        print(f"  {kernel:8s} " + ", ".join(f"{k} {v}" for k, v in spread[kernel].items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bandwidth.json").write_text(json.dumps(
        {"machine": machine(), "load_at_start": load, **spread,
         "reads_GBs": {k: [round(r, 2) for r in v] for k, v in probe.reads.items()}}, indent=1))


if __name__ == "__main__":
    main()
