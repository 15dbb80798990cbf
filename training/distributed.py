"""Several processes training one model, through JAX's own distributed runtime.

`jax.distributed.initialize` does the work (we build no transport of our own): process 0
hosts the coordination service at `--coordinator`, every process connects to it, and from
then on `jax.devices()` lists every process's devices, so `sharding.make_mesh` spans them
all and the jitted train step runs as one program over all of them (the cross-process
collectives are NCCL on GPU, the interconnect on TPU, gloo over TCP on CPU). This module is
the part JAX leaves to the program:

- when to start it: `--coordinator/--num-processes/--process-id`, or with none of them
  when a launcher started several tasks (SLURM `srun`, Open MPI `mpirun`: JAX reads the
  rest from their environment), or always with `--distributed on` (Cloud TPU pods,
  Kubernetes); before any other JAX work;
- bounded, clear failures: a coordinator that never answers, processes started with
  different flags or corpora, a process lost in the middle of a run;
- process-local copies of arrays that span processes (checkpoint digests, samples).

The launch checks, the bounded start, `check_same` and `exit_now` are shared with
multi-host serving and live in `gpt_jax.distributed`; their names are imported here.

Usage (two processes on this machine; on a cluster, process 0's host and a free port):
  python -m training.train --preset tiny --coordinator 127.0.0.1:5000 --num-processes 2 --process-id 0 &
  python -m training.train --preset tiny --coordinator 127.0.0.1:5000 --num-processes 2 --process-id 1
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Annotated, Literal

import jax
import numpy as np
import tyro

# DistributedError, check_same and exit_now: training's names too
from gpt_jax.distributed import (DistributedError, check_launch, check_same,  # noqa: F401
                                 exit_now, join)

Mode = Literal["auto", "on", "off"]
MODES = typing.get_args(Mode)


class RunAborted(RuntimeError):
    """A multi-process run failed after it started (another process stopping shows here
    as a failed collective); the message says where to resume."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (see training/README.md). Not part of
    TrainConfig: it differs between the processes of one run, and a run may resume on
    another process count.

    Raises:
      ValueError: a value out of range (naming the flag, the value and the range).
    """

    # auto: start jax.distributed when --coordinator, --num-processes or --process-id is
    # given, or SLURM (srun) or Open MPI (mpirun) started several tasks; on: always (JAX
    # reads the rest from the environment: Cloud TPU, Kubernetes); off: never
    mode: Annotated[Mode, tyro.conf.arg(name="distributed")] = "auto"
    # process 0's address and a free port, where the others connect; the same on every process
    coordinator: Annotated[str | None, tyro.conf.arg(metavar="HOST:PORT")] = None
    # processes in the run; the same on every process
    num_processes: Annotated[int | None, tyro.conf.arg(metavar="N")] = None
    # this process, 0 .. N-1 (process 0 hosts the coordinator)
    process_id: Annotated[int | None, tyro.conf.arg(metavar="I")] = None
    # wait at most S seconds for every process to join (JAX's default)
    init_timeout_s: Annotated[int, tyro.conf.arg(metavar="S")] = 300
    # a process silent for S seconds is declared dead and the run stops (JAX's default)
    heartbeat_timeout_s: Annotated[int, tyro.conf.arg(metavar="S")] = 100

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--distributed must be one of {MODES}, got {self.mode!r}")
        check_launch(self.coordinator, self.num_processes, self.process_id,
                     self.init_timeout_s, self.heartbeat_timeout_s)
        if self.mode == "off" and self.flags_given:
            raise ValueError("--distributed off contradicts --coordinator/--num-processes/"
                             "--process-id")

    @property
    def flags_given(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes,
                                           self.process_id))


def launcher_processes() -> int | None:
    """Tasks a launcher started, from the environment JAX's own detection reads: SLURM
    (inside `srun`) or Open MPI (`mpirun`); None when neither launched this process."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
             "SLURM_LOCALID")
    if all(name in os.environ for name in slurm):
        return int(os.environ["SLURM_NTASKS"])
    if "OMPI_MCA_orte_hnp_uri" in os.environ and "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    return None


def should_start(dist: DistributedConfig) -> bool:
    if dist.mode != "auto":
        return dist.mode == "on"
    return dist.flags_given or (launcher_processes() or 1) > 1 \
        or "JAX_COORDINATOR_ADDRESS" in os.environ


def expected_processes(dist: DistributedConfig) -> int:
    """The process count as known before starting (flags, else the launcher), else 1."""
    if not should_start(dist):
        return 1
    return dist.num_processes or launcher_processes() or 1


def start(dist: DistributedConfig) -> None:
    """`jax.distributed.initialize` when `dist` says so (`gpt_jax.distributed.join`); call
    it before any other JAX work.

    Raises:
      DistributedError: the coordinator never answered (processes other than 0), or its
        port could not be opened (process 0).
    """
    if should_start(dist):
        join(dist.coordinator, dist.num_processes, dist.process_id, dist.init_timeout_s,
             dist.heartbeat_timeout_s)


def is_primary() -> bool:
    """Process 0: the one that prints, logs metrics and plots."""
    return jax.process_index() == 0


def on_process_0(make):
    """`make()` (a pytree of arrays), computed by process 0 alone and sent to every process
    (as host arrays); the others only trace it for the shapes, so they skip computing, and
    compiling, it. A collective with several processes; just `make()` with one."""
    if jax.process_count() == 1:
        return make()
    from jax.experimental import multihost_utils

    mine = make() if is_primary() else jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(make))
    return multihost_utils.broadcast_one_to_all(mine)


def local_copy(tree):
    """The pytree with every array whole on this process (a replicated array's local copy;
    an array split over several processes gathered, a collective every process must join)."""
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


