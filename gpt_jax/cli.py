"""The `gpt-jax` command: `gpt-jax {data,train,generate,serve,chat,export,demo,bench} [flags]`;
`gpt-jax CMD --help`.

The dispatcher only: each command lives where its job is (`training.data`, `training.train`,
`inference.cli`, `inference.serve`, `inference.chat_cli`, `inference.export`, `training.demo`,
benchmarks/bench.py) and is imported here lazily, when it is asked for. This module is the
model package's one documented exception to "gpt_jax imports nothing above it"
(tests/test_cli.py holds the import graph to that); nothing imports it back.
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = """usage: gpt-jax COMMAND [flags]; gpt-jax --version

commands:
  data       download the built-in Shakespeare corpus and print its size
  train      train a model (python -m training.train)
  generate   generate text from a trained run or a Hugging Face directory (inference.cli)
  serve      an OpenAI-compatible HTTP server on the serving engine (inference.serve)
  chat       talk with a model in the terminal through its chat template (inference.chat_cli)
  export     the whole generation program, weights inside, as one jax.export file that
             a process with only jax runs (inference.export)
  demo       data, train shakespeare-char within a time budget (once), generate (make demo)
  bench      run a benchmark from benchmarks/: gpt-jax bench NAME [flags], NAME one of
             throughput, live-length, roofline, ttft, compiles (speed.py) or
             another script's name (benchmarks/NAME.py; `gpt-jax bench` lists all of
             them, benchmarks/README.md says what each measures); gpt-jax bench NAME --help
"""


def bench_main(argv: list[str]) -> int:
    """benchmarks/bench.py's `main`, with benchmarks/ on sys.path (where its scripts import
    each other from), when this is a source checkout."""
    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if not (folder / "bench.py").is_file():
        print(f"gpt-jax bench: benchmarks/ must be in this checkout: {folder}",
              file=sys.stderr)
        return 2
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    from bench import main

    return main(argv)


def dispatch(argv: list[str], own_process: bool) -> int:
    """Run the command `argv[0]` with the flags after it; the exit status."""
    command, rest = argv[0], argv[1:]
    if command == "data":
        from training.data import main as data_main

        data_main(rest)
    elif command == "train":
        from training.train import main as train_main

        train_main(rest, own_process=own_process)
    elif command == "generate":
        from inference.cli import main as generate_main

        generate_main(rest)
    elif command == "serve":
        from inference.serve import main as serve_main

        serve_main(rest)
    elif command == "chat":
        from inference.chat_cli import main as chat_main

        return chat_main(rest)
    elif command == "export":
        from inference.export import main as export_main

        export_main(rest)
    elif command == "demo":
        from training.demo import main as demo_main

        demo_main(rest)
    elif command == "bench":
        return bench_main(rest)
    else:
        print(f"gpt-jax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return 0


def main(argv=None):
    """The command line (`argv` None: this process's own, `sys.argv`) or a call from Python
    (a large model's training run restarts itself only from its own process); a reader
    closing stdout early ends it quietly."""
    from training.process import closed_pipe_is_quiet

    def command(argv):
        own_process, argv = argv is None, sys.argv[1:] if argv is None else argv
        if not argv or argv[0] in ("-h", "--help"):
            print(USAGE)
            return 0
        if argv[0] == "--version":
            from importlib.metadata import version

            print(f"gpt-jax {version('gpt-jax')}")
            return 0
        return dispatch(argv, own_process)

    return closed_pipe_is_quiet(command)(argv)


if __name__ == "__main__":
    sys.exit(main())
