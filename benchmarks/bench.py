"""`gpt-jax bench NAME [flags]`: run benchmarks/speed.py NAME (the speed benchmarks) or
benchmarks/NAME.py, from a source checkout (benchmarks/ is not installed)."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

# How to install the comparison's PyTorch: the local CPU build, before transformers (which
# would otherwise pull a multi-GB CUDA build), as the Makefile's test install does.
INSTALL_TORCH = "`pip install torch==2.13.0 transformers`, torch first"

SPEED_BENCHMARKS = ("throughput", "live-length", "roofline", "ttft", "compiles")

# What a benchmark needs beyond the `make test` venv: (module, the extra that installs it,
# the flag that leaves out what needs it). `transformers serve` needs accelerate.
EXTRA_NEEDS = {"serve": ("accelerate", "bench", "--servers gpt-jax")}


def missing_extra(name: str, args: list[str]) -> str | None:
    """The one line saying which extra benchmark `name` (run with `args`) needs and lacks;
    None when nothing is missing, or the flags leave out what needs it."""
    if name not in EXTRA_NEEDS or {"-h", "--help"} & set(args):  # help needs nothing
        return None
    module, extra, without = EXTRA_NEEDS[name]
    flag, value = without.split()
    if flag in args and "transformers" not in args[args.index(flag) + 1:]:
        return None  # only the gpt-jax server: nothing of the extra runs
    if importlib.util.find_spec(module) is not None:
        return None
    return (f"gpt-jax bench {name}: needs {module}, the `{extra}` extra: `pip install -e "
            f"'.[{extra}]'` in the checkout; or pass {flag} {value} to leave transformers out")


def benchmark_names() -> list[str]:
    """Every NAME `gpt-jax bench` runs: the speed benchmarks, then the other scripts here."""
    scripts = sorted(p.stem for p in Path(__file__).resolve().parent.glob("*.py"))
    return list(SPEED_BENCHMARKS) + [s for s in scripts if s not in ("speed", "bench")]


def main(argv: list[str]) -> int:
    """Run the benchmark `argv[0]` with the flags after it; its exit status (1 when it needs
    torch, transformers or an extra's package and they are not installed, 2 for an unknown
    name)."""
    folder = Path(__file__).resolve().parent
    names = benchmark_names()
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: gpt-jax bench NAME [flags]; NAME one of {', '.join(names)}; "
              "gpt-jax bench NAME --help for its flags (benchmarks/README.md)")
        return 0
    if not argv or argv[0] not in names:
        got = repr(argv[0]) if argv else "nothing"
        print(f"gpt-jax bench: got {got}; choose one of {', '.join(names)}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if (missing := missing_extra(name, rest)) is not None:
        print(missing, file=sys.stderr)
        return 1
    script, args = (("speed", [name] + rest) if name in SPEED_BENCHMARKS else (name, rest))
    sys.argv = [f"gpt-jax bench {name}"] + args
    path = folder / f"{script}.py"
    try:
        runpy.run_path(str(path), run_name="__main__")
    except ModuleNotFoundError as error:
        if error.name not in ("torch", "transformers"):
            raise
        skip = "; or pass --no-hf to leave transformers out" if "--no-hf" in \
            path.read_text() else ""
        print(f"gpt-jax bench {name}: needs {error.name}, which `make test` installs (or "
              f"{INSTALL_TORCH}){skip}", file=sys.stderr)
        return 1
    return 0
