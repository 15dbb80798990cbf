"""The int8 matmul on CPU: the C++ kernel against XLA's widen-then-dot and XLA's float32 dot,
by row count; and what XLA:CPU compiles a plain int8 matmul to (the reason for the kernel:
a float32 copy of the whole matrix that its dot then reads, or, for one row, the dot in an
elementwise loop).

Usage (also `gpt-jax bench int8_matmul [flags]`; writes benchmarks/results/int8_matmul.json
and .png):
  python benchmarks/int8_matmul.py                       # rows 1, 8, 64, 256, 1024
  python benchmarks/int8_matmul.py --rows 1 8 --rounds 9

Each timed call multiplies one input by the three matrix shapes of a GPT-2 block (768 x
2304, 768 x 3072, 3072 x 768; int8 per-channel weights from `gpt_jax.layers.Int8Weight`),
the paths in turn, best of `--rounds`: `kernel` (`gpt_jax.kernels.panel_matmul`), `xla` (XLA's path of
`gpt_jax.layers.int8_matmul`: widen the int8 values, dot, scale) and `float32` (the float
weights, XLA's dot).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import save  # noqa: E402

from gpt_jax.kernels import panel_matmul as panel_kernel  # noqa: E402
from gpt_jax.layers import Int8Weight  # noqa: E402

SHAPES = ((768, 2304), (768, 3072), (3072, 768))  # (I, O) of a GPT-2 block's matrices


def xla_path(x_MI, w: Int8Weight):
    """`gpt_jax.layers.int8_matmul`'s XLA path (what GPUs and TPUs run)."""
    O, I = w.shape
    q_OI = jnp.swapaxes(w.values, 1, 2).reshape(-1, I)[:O]
    return (x_MI @ q_OI.astype(jnp.float32).T) * w.scale_O[None]


def xla_compiles(M: int, O: int, I: int) -> str:
    """What XLA:CPU compiles `x @ q.astype(float32).T` to, for int8 `q` `[O, I]` and `M`
    rows: "float32 copy + dot" (a fusion writes the whole matrix out as float32 `[O, I]` and
    a dot reads the copy), "loop fusion dot" (the dot computed inside an elementwise loop
    fusion, not by a matmul library), or "other"."""
    x = jax.ShapeDtypeStruct((M, I), jnp.float32)
    q = jax.ShapeDtypeStruct((O, I), jnp.int8)
    hlo = jax.jit(lambda x, q: x @ q.astype(jnp.float32).T).lower(x, q).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    copy = re.search(rf"%(\S+) = f32\[{O},{I}\]\S* fusion\(", entry)
    if copy and re.search(rf"\(.*%{re.escape(copy.group(1))}\b", entry[copy.end():]):
        return "float32 copy + dot"
    if re.search(r"= f32\[[\d,]+\]\S* fusion\([^\n]*kind=kLoop[^\n]*dot_general", entry):
        return "loop fusion dot"
    return "other"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench int8_matmul",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not panel_kernel.available():
        raise SystemExit("the CPU int8 kernel is not available (see the warning above)")
    rng = np.random.default_rng(0)
    floats = [jnp.asarray(0.02 * rng.standard_normal((O, I), np.float32)) for I, O in SHAPES]
    quantized = [jax.jit(Int8Weight.quantize)(w) for w in floats]
    paths = {
        "kernel": (jax.jit(lambda xs, ws: [panel_kernel.int8_matmul(x, w.values, w.scale_O)
                                           for x, w in zip(xs, ws)]), quantized),
        "xla": (jax.jit(lambda xs, ws: [xla_path(x, w) for x, w in zip(xs, ws)]), quantized),
        "float32": (jax.jit(lambda xs, ws: [x @ w.T for x, w in zip(xs, ws)]), floats),
    }
    compiled = {M: sorted({xla_compiles(M, O, I) for I, O in SHAPES}) for M in args.rows}
    print(f"XLA:CPU compiles x @ int8[O, I].astype(float32).T, by rows, to: {compiled}")
    rows = []
    for M in args.rows:
        xs = [jnp.asarray(rng.standard_normal((M, I), np.float32)) for I, _ in SHAPES]
        for fn, ws in paths.values():
            jax.block_until_ready(fn(xs, ws))  # compile, untimed
        times = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, (fn, ws) in paths.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(xs, ws))
                times[name].append(time.perf_counter() - start)
        flops = 2 * M * sum(I * O for I, O in SHAPES)
        int8_bytes = sum(I * O for I, O in SHAPES)
        row = {"rows": M}
        for name, t in times.items():
            best = min(t)
            row[f"{name}_ms"] = 1e3 * best
            row[f"{name}_GFLOPs"] = flops / best / 1e9
        row["kernel_int8_GBs"] = int8_bytes / min(times["kernel"]) / 1e9
        row["x_xla"] = row["xla_ms"] / row["kernel_ms"]
        row["x_float32"] = row["float32_ms"] / row["kernel_ms"]
        rows.append(row)

    def plot(ax, rows):
        for name in paths:
            ax.plot([r["rows"] for r in rows], [r[f"{name}_GFLOPs"] for r in rows], "o-",
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (M)")
        ax.set_ylabel("GFLOP/s, one GPT-2 block's three matrix shapes")
        ax.legend()

    save("int8_matmul", rows, plot, {"shapes_IO": SHAPES, "rounds": args.rounds,
                                     "xla_compiles_plain_int8_matmul_to": compiled})


if __name__ == "__main__":
    main()
