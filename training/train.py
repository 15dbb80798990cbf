"""Train a GPT on a text corpus, with checkpoints, resume, evaluation and plots.

Usage:
  gpt-jax train                                          # shakespeare-char on the plays
  gpt-jax train --preset nanogpt-cpu --text tinyshakespeare.txt --run-dir runs/nano
  gpt-jax train --text my.txt --run-dir runs/mine --max-steps 2000 --tokenizer bpe
  gpt-jax train --run-dir runs/x                         # resumes it from its checkpoints
  gpt-jax train --cpu-devices 4 --devices 4 --shard-params true
  gpt-jax train --coordinator HOST0:5000 --num-processes 2 --process-id 0   # on
  gpt-jax train --coordinator HOST0:5000 --num-processes 2 --process-id 1   # each
(`python -m training.train` is the same command.)

`--preset` picks a TrainConfig preset (training/config.py) and every TrainConfig field is a
flag overriding it, e.g. `--batch-size 64`; the resolved config is saved as
train_config.json. On CPU the host is split into one XLA device per core (`--cpu-devices`)
and the batch is data-parallel over them. A run resumes from its latest good checkpoint; the
batch for step s depends only on (seed, s), so a resumed run sees exactly the data an
uninterrupted run would have seen. Several processes (hosts) train one model through
`jax.distributed`: training/distributed.py, and training/README.md for SLURM and ssh.

This module is the run's entry: `train(cfg)` sets a run up from its directory
(training/run_dir.py) and hands it to the loop (training/loop.py); and the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import jax
import jax.numpy as jnp
import tyro

from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.params import param_count
from training import distributed, process, report, sharding
from training.config import TRAIN_PRESETS, TrainConfig
from training.loop import Loop
from training.process import closed_pipe_is_quiet, restart_with_huge_pages
from training.run_dir import (check_block_size, check_same_corpus, prepare_run,
                               start_or_resume)
from training.step import init_state, make_optimizer, make_train_steps


def _count(n: int, one: str, many: str) -> str:
    """"1 device", "2 devices"."""
    return f"{n} {one if n == 1 else many}"


def split_host(cfg: TrainConfig, processes: int = 1) -> None:
    """Split the host CPU into XLA devices for data parallelism (`sharding.split_host_cpu`):
    `cfg.cpu_devices` of them, or for 0 the largest count that is at most the core count
    and, times `processes` (each splitting its host alike), divides `batch_size`, unless
    XLA_FLAGS already sets --xla_force_host_platform_device_count (then that count stands).
    The command line calls this before JAX's first operation.

    Raises:
      RuntimeError: JAX has already run an operation (from `jax.config`).
    """
    n = cfg.cpu_devices
    if not n:
        if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
            return
        n = max((d for d in range(1, min(sharding.host_cores(), cfg.batch_size) + 1)
                 if cfg.batch_size % (d * processes) == 0), default=1)
    sharding.split_host_cpu(n)


def train(cfg: TrainConfig, *, on_eval=None, started: float | None = None) -> dict[str, Any]:
    """Train (or resume) a run. Returns a summary: steps, losses, tokens/s, seconds.

    A time budget (`cfg.time_budget_s`) counts from `started` (a `time.perf_counter()`
    value, earlier when the caller's own preparation counts too: the demo's imports of this
    module took 2.5 s on a loaded machine), else from this call: setup, compiling, the steps
    and the final evaluation and checkpoint all fit in it (`Loop.out_of_time`), and
    max_steps is raised or lowered to what fits in it (`Loop.fit_to_budget`).
    `on_eval(step, params)` is called after each evaluation; the next step donates those
    params' buffers, so copy them (`jax.device_get`) to keep them.
    """
    started = time.perf_counter() if started is None else started
    mesh = sharding.make_mesh(cfg.devices)
    if cfg.batch_size % mesh.devices.size:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the "
                         f"{mesh.devices.size} devices of the mesh (set --devices, or "
                         "--cpu-devices on CPU)")
    config, tokenizer, batches = prepare_run(cfg)
    check_same_corpus(batches, config)
    cfg = dataclasses.replace(cfg, block_size=batches.block)
    optimizer = make_optimizer(cfg)
    state, shardings = init_state(cfg, config, optimizer, mesh)
    mngr = checkpoint.manager(cfg.run_dir, cfg.keep_checkpoints)
    state, start, elapsed0 = start_or_resume(cfg, config, tokenizer, state, mngr)
    flops_per_token = report.flops_per_token(config, state.params, batches.block)
    peak = cfg.peak_flops or report.measure_peak_flops(mesh)
    if distributed.is_primary():
        print(f"model preset {cfg.model}: {param_count(state.params) / 1e6:.2f}M params, vocab "
              f"{config.vocab_size}, block {batches.block}, {len(batches.train):,} train "
              f"tokens, {_count(mesh.devices.size, 'device', 'devices')} in "
              f"{_count(jax.process_count(), 'process', 'processes')}, "
              f"peak {peak / 1e9:.0f} GFLOP/s")

    def make_step(cfg: TrainConfig):  # a new max_steps only moves the schedule's end
        return make_train_steps(config, make_optimizer(cfg), jnp.dtype(cfg.compute_dtype),
                                shardings)

    loop = Loop(cfg, config, tokenizer, batches, mesh, mngr, flops_per_token, peak, elapsed0,
                started)
    loop.run(make_step, state, start, on_eval)
    mngr.close()  # not on a failure: after a lost process its barriers could wait long
    return loop.summary()


def _parse_bool(args: list[str]) -> bool:
    value = args[0].lower()
    if value not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"expected true or false, got {args[0]!r}")
    return value in ("1", "true", "yes")


# Boolean flags take a value (`--shard-params true`), in any case, as they always have.
_FLAG_TYPES = tyro.constructors.ConstructorRegistry()


@_FLAG_TYPES.primitive_rule
def _bool_flag(info: tyro.constructors.PrimitiveTypeInfo):
    if info.type is not bool:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="{true,false}", instance_from_str=_parse_bool,
        is_instance=lambda x: isinstance(x, bool), str_from_instance=lambda x: [str(x).lower()])


def _unchecked(cls):
    """`cls` (a frozen dataclass) without its `__post_init__` checks, for tyro to fill in:
    tyro turns a ValueError raised while it builds a class into its own error box (exit 2),
    where the command line's errors are one `gpt-jax train: MESSAGE` line. `parse_args` builds
    `cls` itself from the values, which checks them. Help, defaults and names are
    inherited."""
    namespace = {"__post_init__": lambda self: None, "__doc__": cls.__doc__,
                 "__module__": cls.__module__}
    return dataclasses.dataclass(frozen=True)(type(cls.__name__, (cls,), namespace))


_TrainFlags = _unchecked(TrainConfig)
_DistributedFlags = _unchecked(distributed.DistributedConfig)
_PRESET_HELP = (f"one of {sorted(TRAIN_PRESETS)}; without it, the run directory's saved "
                "train_config.json, else shakespeare-char; the flags below override it")


@dataclasses.dataclass(frozen=True)
class Flags:
    """The command line: a preset, every TrainConfig field over it, how to join others."""

    preset: Annotated[str | None, tyro.conf.arg(help=_PRESET_HELP)] = None
    train: Annotated[_TrainFlags, tyro.conf.OmitArgPrefixes] = _TrainFlags()
    distributed: Annotated[_DistributedFlags, tyro.conf.OmitArgPrefixes] = _DistributedFlags()


# The title and the usage lines: tyro joins the lines of a paragraph into one, unwrapped.
_DESCRIPTION = "\n\n".join(__doc__.split("\n\n")[:2])


def _flags(argv: list[str], default: Flags, first_pass: bool = False):
    """`tyro.cli` over `Flags`; the first pass ignores what it does not know and --help."""
    return tyro.cli(Flags, args=argv, default=default, description=_DESCRIPTION,
                    prog="gpt-jax train",  # as `gpt-jax serve` and `gpt-jax export` name theirs
                    registry=_FLAG_TYPES, config=(tyro.conf.FlagConversionOff,),
                    add_help=not first_pass, return_unknown_args=first_pass)


def base_config(preset: str | None, run_dir: str) -> TrainConfig:
    """What the flags given override: the `preset` named, else the run directory's saved
    train_config.json (so `--run-dir DIR` alone resumes that run as it was started, and
    `--max-steps N` extends it), else the shakespeare-char preset."""
    saved = Path(run_dir) / "train_config.json"
    if preset is None and saved.exists():
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        return TrainConfig(**{k: v for k, v in json.loads(saved.read_text()).items()
                              if k in fields})
    return TrainConfig.preset(preset or "shakespeare-char")


def parse_args(argv=None) -> tuple[TrainConfig, distributed.DistributedConfig]:
    """The TrainConfig of the flags given over `base_config`, and how this process joins a
    multi-process run. `--help` lists every flag with its help and its default here (the
    base's value).

    Raises:
      ValueError: an unknown preset, or a value out of range (TrainConfig's and
        DistributedConfig's messages).
      SystemExit: an unknown flag or a value of the wrong type (tyro's message), or --help.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # A first pass reads where the defaults come from (--preset, --run-dir); the second
    # parses every flag over them.
    first, _ = _flags([a for a in argv if a not in ("-h", "--help")], Flags(), True)
    base = base_config(first.preset, first.train.run_dir)
    flags = _flags(argv, Flags(first.preset, _TrainFlags(**dataclasses.asdict(base))))
    dist = distributed.DistributedConfig(**dataclasses.asdict(flags.distributed))
    return TrainConfig(**dataclasses.asdict(flags.train)), dist


def config_from_args(argv=None) -> TrainConfig:
    """The TrainConfig of `parse_args`."""
    return parse_args(argv)[0]


def large_buffers(cfg: TrainConfig) -> bool:
    """Whether a train step of `cfg`'s model allocates buffers past glibc's largest mmap
    threshold (32 MiB on 64-bit: each such allocation is a fresh mmap, mapped on first touch):
    its stacked MLP weight or its embedding table is that large (the gradients, moments and
    logits are of the same order).

    Such steps spend much of their time in page faults, which huge pages (see
    `training.process.restart_with_huge_pages`) remove; a small model's step (arrays the heap
    reuses) runs slower with them, so small models keep 4 KiB pages (figures:
    training/README.md, "One flat all-reduce, and huge pages")."""
    config = GPTConfig.preset(cfg.model)
    largest = max(config.n_layers * config.d_model * config.d_ff,
                  config.vocab_size * config.d_model) * 4
    return largest >= 32 << 20


def resume_note(cfg: TrainConfig | None) -> str:
    """What an interrupted run left: its newest checkpoint, which the same command resumes."""
    folder = Path(cfg.run_dir, "checkpoints") if cfg else None
    steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) \
        if folder and folder.is_dir() else []
    if not steps:
        return "no checkpoint was saved"
    return f"the same command resumes from the checkpoint at step {steps[-1]} in {cfg.run_dir}"


def main(argv=None, own_process: bool = False):
    """Parse, join the other processes (if any) before any JAX work, check they all run the
    same flags, train; process 0 prints the summary. `own_process` (the command line, not a
    call from Python): a large model's run first restarts itself with huge pages
    (`large_buffers`)."""
    cfg = None
    try:
        cfg, dist = parse_args(argv)
        check_block_size(cfg)  # before any work: the corpus read, other processes joined
        if own_process and large_buffers(cfg):
            restart_with_huge_pages("training.train", sys.argv[1:] if argv is None else argv)
        processes = distributed.expected_processes(dist)
        if cfg.batch_size % processes:  # known before starting: no process waits for this
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the "
                             f"{processes} processes (each feeds batch_size / processes rows)")
        split_host(cfg, processes)
        distributed.start(dist)
        distributed.check_same("flags", dataclasses.asdict(cfg))
        with process.sigterm_stops():
            summary = train(cfg)
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM: checkpoints are whole (Loop.checkpoint)
        terminated = isinstance(stop, process.Terminated)
        print(f"\ngpt-jax train: {'stopped by SIGTERM' if terminated else 'interrupted'}; "
              f"{resume_note(cfg)}", file=sys.stderr)
        raise SystemExit(143 if terminated else 130) from None  # the shell's statuses
    except distributed.RunAborted as error:  # the others may be gone: leave without them
        distributed.exit_now(f"gpt-jax train: {error}")
    except (ValueError, FileNotFoundError, distributed.DistributedError) as error:
        # bad input: a one-line error, naming the flag (TrainConfig.max_steps: --max-steps)
        flags = re.sub(r"\bTrainConfig\.(\w+)",
                       lambda m: "--" + m.group(1).replace("_", "-"), str(error))
        raise SystemExit(f"gpt-jax train: {flags}") from None
    if distributed.is_primary():
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(closed_pipe_is_quiet(main)(own_process=True))
