"""The `gpt-jax` command: `gpt-jax {data,train,generate,serve,export,demo,bench} [flags]`;
`gpt-jax CMD --help`."""

from __future__ import annotations

import os
import sys

USAGE = """usage: gpt-jax COMMAND [flags]

commands:
  data       download the built-in Shakespeare corpus and print its size
  train      train a model (python -m training.train)
  generate   generate text from a trained run (python -m inference.cli)
  serve      an OpenAI-compatible HTTP server on the serving engine (inference.server)
  export     the whole generation program, weights inside, as one jax.export file that
             a process with only jax runs (inference.export)
  demo       data, train shakespeare-char within a time budget (once), generate (make demo)
  bench      run a benchmark from benchmarks/: gpt-jax bench NAME [flags], NAME one of
             throughput, live-length, roofline, ttft, compiles (speed.py) or
             another script's name (benchmarks/NAME.py); gpt-jax bench NAME --help
"""

DEMO_PROMPTS = ["Romeo.\n", "Juliet.\n", "Ham.\n", "MACBETH.\n"]  # as the plays mark speakers
DEMO_NEW_TOKENS = 500  # characters per speaker, as nanoGPT's sample.py writes


def data_main(argv):
    from training.data import shakespeare_plays

    plays = shakespeare_plays()
    print(f"{len(plays)} plays, {sum(map(len, plays.values())):,} characters")


def demo_main(argv):
    """The main job: corpus, training (skipped when the run finished before), generation."""
    import argparse
    import json
    import os
    import time
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="gpt-jax demo")
    parser.add_argument("--run-dir", default="runs/shakespeare-char")
    parser.add_argument("--train-seconds", type=float, default=450.0)
    parser.add_argument("--retrain", action="store_true",
                        help="train again; the old run directory is kept as RUN_DIR.old-TIME")
    parser.add_argument("--max-new-tokens", type=int, default=DEMO_NEW_TOKENS,
                        help="characters per speaker; past the model's context each is "
                             "predicted from the last max_seq_len (nanoGPT's crop)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    from training.config import TrainConfig

    try:  # bad input stops here, before the previous run is touched
        cfg = TrainConfig(run_dir=str(run_dir), time_budget_s=args.train_seconds)
    except ValueError as error:
        raise SystemExit(f"demo: {error}") from None

    phases = {}

    tick = time.perf_counter()
    data_main([])
    phases["data"] = time.perf_counter() - tick

    tick = time.perf_counter()
    if args.retrain and run_dir.exists():
        kept = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(run_dir, kept)
        print(f"previous run kept as {kept}")
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        from training.report import read_metrics

        summary = json.loads(summary_path.read_text())
        print(f"reusing the trained model in {run_dir} (--retrain to train again)")
        last = (read_metrics(run_dir) or [{"step": -1}])[-1]  # a line per checkpoint
        if last["step"] > summary["steps"]:  # trained further since (gpt-jax train resumed)
            print(f"{summary_path} is from step {summary['steps']}, but the run has trained "
                  f"to step {last['step']} since: figures from metrics.jsonl's last line")
            summary = {**last, "steps": last["step"]}
    else:
        import dataclasses

        from gpt_jax.checkpoint import write_json_atomic
        from training.train import base_config, split_host, train

        # A demo run stopped part-way resumes as it was started: max_steps as its time
        # budget fitted them, so the schedule does not change under it.
        cfg = dataclasses.replace(base_config(None, run_dir), run_dir=str(run_dir),
                                  time_budget_s=args.train_seconds)
        split_host(cfg)
        summary = train(cfg)
        write_json_atomic(summary_path, summary)
    phases["train"] = time.perf_counter() - tick
    cut = summary.get("max_steps", summary["steps"]) > summary["steps"]  # the budget ended it
    steps = f"{summary['steps']} of {summary['max_steps']}" if cut else summary["steps"]
    print(f"training: {steps} steps, {summary['tokens_per_s']:,.0f} tokens/s, "
          f"train loss {summary['train_loss']:.3f}, val loss {summary['val_loss']:.3f} "
          f"nats/char; model in {run_dir}")

    tick = time.perf_counter()
    from inference.cli import main as generate_main

    # The four speakers in one batch, each well past the model's context (crop).
    generate_main(["--run-dir", str(run_dir), "--max-new-tokens", str(args.max_new_tokens),
                   "--context-overflow", "crop", "--report"]
                  + [a for p in DEMO_PROMPTS for a in ("--prompt", p)])
    phases["generate"] = time.perf_counter() - tick
    print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))


HUGE_PAGES = "glibc.malloc.hugetlb=1"


def restart_with_huge_pages(module: str, argv: list[str]) -> None:
    """Restart this process as `python -m module *argv` (the same pid and environment) with
    glibc's malloc asking the kernel for transparent huge pages (`GLIBC_TUNABLES` +=
    `glibc.malloc.hugetlb=1`, glibc 2.35 and later), unless the variable already names that
    tunable or this is not Linux. Call it before any work: nothing after it runs twice.
    Other C libraries ignore the variable.

    What for: `training.train` restarts so when its buffers are large (`large_buffers`);
    see there for the measurements.
    """
    if not sys.platform.startswith("linux") or \
            "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], huge_pages_environ())


def huge_pages_environ() -> dict[str, str]:
    """This process's environment with `HUGE_PAGES` added to `GLIBC_TUNABLES` (after any
    tunables already there)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGE_PAGES]))}


# How to install the comparison's PyTorch: the local CPU build, before transformers (which
# would otherwise pull a multi-GB CUDA build), as the Makefile's test install does.
INSTALL_TORCH = "`pip install torch==2.13.0 transformers`, torch first"

SPEED_BENCHMARKS = ("throughput", "live-length", "roofline", "ttft", "compiles")


def bench_main(argv):
    """Run benchmarks/speed.py NAME or benchmarks/NAME.py (from a source checkout)."""
    import runpy
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []
    names = list(SPEED_BENCHMARKS) + [s for s in scripts if s != "speed"]
    if argv[:1] in (["-h"], ["--help"]) and names:
        print(f"usage: gpt-jax bench NAME [flags]; NAME one of {', '.join(names)}; "
              "gpt-jax bench NAME --help for its flags (benchmarks/README.md)")
        return 0
    if not argv or argv[0] not in names:
        got = repr(argv[0]) if argv else "nothing"
        print(f"gpt-jax bench: got {got}; choose one of {', '.join(names)} "
              f"(benchmarks/ must be in this checkout: {folder})", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
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


def closed_pipe_is_quiet(main_fn):
    """`main_fn` wrapped so that a reader closing stdout early (`gpt-jax train --help |
    head`) ends the command with status 1 and no traceback: stdout is pointed at /dev/null
    so the interpreter's last flush does not raise again (as Python's signal docs advise)."""
    def run(*args, **kwargs):
        try:
            return main_fn(*args, **kwargs)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    return run


@closed_pipe_is_quiet
def main(argv=None):
    own_process, argv = argv is None, sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "data":
        data_main(rest)
    elif command == "train":
        from training.train import main as train_main

        train_main(rest, own_process=own_process)
    elif command == "generate":
        from inference.cli import main as generate_main

        generate_main(rest)
    elif command == "serve":
        from inference.server import main as serve_main

        serve_main(rest)
    elif command == "export":
        from inference.export import main as export_main

        export_main(rest)
    elif command == "demo":
        demo_main(rest)
    elif command == "bench":
        return bench_main(rest)
    else:
        print(f"gpt-jax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
