"""Multi-host serving: one `Engine` whose mesh spans the devices of several processes.

    gpt-jax serve --hf-checkpoint DIR --tensor-parallel 2 --coordinator 127.0.0.1:5000 \
        --num-processes 2 --process-id 0    # HTTP, the scheduler, the engine loop
    gpt-jax serve --hf-checkpoint DIR --tensor-parallel 2 --coordinator 127.0.0.1:5000 \
        --num-processes 2 --process-id 1    # a follower: runs process 0's programs

Every process joins `jax.distributed` (`gpt_jax.distributed.join`, the training flags'
meaning), loads the same weights and builds the same `Engine` over one mesh of every
process's devices (JAX's multi-controller model: each process runs the same jitted program
on its own devices, and the programs' collectives cross processes). Process 0 alone serves
HTTP and schedules; the other processes (followers) only run programs. Every call the
engine makes into its jitted programs (`engine_prefill`, `engine_decode`, the warmup's
too) goes through the engine's program hooks (`Engine.prefill_program`,
`decode_program`), which `lead` sets: the call's host arrays (page table, prompt rows,
sampling and stop arrays) and static arguments are first sent, as a `Plan`, through the
key-value store of JAX's own distributed client (`key_value_set_bytes` /
`blocking_key_value_get_bytes`, one key per follower and message, deleted once read), then
run; `follow` loops: receive, run the same program on its copy of the engine's device
state. The one eager change to that state outside the programs (`Engine.add_request`
widening the recent-token window, `inference.decode.widen_recent`) travels as the width in
every plan.

Failures are JAX's to detect, within a bound: a lost process stops sending heartbeats and
the coordination service ends the others after `--heartbeat-timeout-s` (JAX's message names
the task); a lost peer inside a step fails the step's collective, and the process exits with
our line. SIGTERM on process 0 drains the HTTP requests, then sends every follower a stop
plan, and all exit 0.

Not served across processes: speculative decoding (its draft state lives on process 0;
such a request is refused with a 400), and `--run-dir` checkpoints (their loader is
single-process: `gpt_jax.hf.save_hf` writes one as a Hugging Face directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import threading
import zlib

import jax
import numpy as np

from gpt_jax import distributed
from inference.batching import engine_decode, engine_prefill
from inference.decode import widen_recent
from inference.errors import RequestError
from inference.transfer import to_device

PREFIX = "gpt_jax/serve"  # the key-value store's keys: PREFIX/<follower>/<message number>
POLL_MS = 10_000  # a follower's wait for the next plan before it asks again
INIT_TIMEOUT_S = 300  # the wait for every process to join (JAX's default)
PROGRAMS = {"prefill": engine_prefill, "decode": engine_decode}
# the flags that build the engine, which every process must share (the others, such as
# --port or --api-key, only process 0 reads)
ENGINE_FLAGS = ("hf_checkpoint", "run_dir", "dtype", "quantize", "max_slots", "kv_cache_bytes",
                "tensor_parallel", "coordinator", "num_processes", "heartbeat_timeout_s")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The multi-process flags of `gpt-jax serve` (`gpt-jax train`'s, the same meaning)."""
    p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="serve from several processes (hosts): process 0's address and a free "
                        "port, the same on every process; --tensor-parallel is then the "
                        "device count of all processes together")
    p.add_argument("--num-processes", type=int, metavar="N", default=None,
                   help="processes serving together (with --coordinator)")
    p.add_argument("--process-id", type=int, metavar="I", default=None,
                   help="this process, 0 .. N-1: process 0 serves HTTP, the others run its "
                        "programs")
    p.add_argument("--heartbeat-timeout-s", type=int, metavar="S", default=30,
                   help="with --coordinator: a process silent for S seconds is declared dead "
                        "and the others stop")


def processes(args: argparse.Namespace) -> int:
    """The process count the flags name (1 without --coordinator)."""
    return args.num_processes if args.coordinator else 1


def check_flags(args: argparse.Namespace) -> None:
    """Stop the command (SystemExit naming the flag) for multi-process flags that cannot
    serve, before anything starts: some but not all of --coordinator, --num-processes and
    --process-id, values out of range, a --tensor-parallel that is not a multiple of the
    process count, or a --run-dir model."""
    given = [args.coordinator, args.num_processes, args.process_id]
    if not any(v is not None for v in given):
        return
    if any(v is None for v in given):
        raise SystemExit("gpt-jax serve: --coordinator, --num-processes and --process-id go "
                         "together; give all three (or none, for one process)")
    try:
        distributed.check_launch(args.coordinator, args.num_processes, args.process_id,
                                 INIT_TIMEOUT_S, args.heartbeat_timeout_s)
    except ValueError as error:
        raise SystemExit(f"gpt-jax serve: {error}") from None
    if args.tensor_parallel % args.num_processes:
        raise SystemExit(f"gpt-jax serve: --tensor-parallel {args.tensor_parallel} must be a "
                         f"multiple of --num-processes {args.num_processes}: the mesh spans "
                         "every process's devices, the same count on each")
    if not args.hf_checkpoint:
        raise SystemExit("gpt-jax serve: --coordinator serves a --hf-checkpoint directory; a "
                         "--run-dir checkpoint loads in one process only (`gpt_jax.hf."
                         "save_hf` writes its params as a Hugging Face directory)")


def start(args: argparse.Namespace) -> Channel | None:
    """Join the processes (`gpt_jax.distributed.join`; call before any other JAX work)
    and check that the mesh spans all their devices and that every process got the same
    ENGINE_FLAGS. Returns the `Channel` of plans, or None for one process.

    Raises:
      SystemExit: no coordinator, a --tensor-parallel other than the device count, or
        flags that differ between the processes (naming them).
    """
    if not args.coordinator:
        return None
    try:
        distributed.join(args.coordinator, args.num_processes, args.process_id,
                         INIT_TIMEOUT_S, args.heartbeat_timeout_s)
        if jax.device_count() != args.tensor_parallel:
            raise ValueError(f"--tensor-parallel {args.tensor_parallel} must be the device "
                             f"count of the {args.num_processes} processes together, "
                             f"{jax.device_count()} ({jax.local_device_count()} here)")
        distributed.check_same("flags", {k: getattr(args, k, None) for k in ENGINE_FLAGS})
    except (distributed.DistributedError, ValueError) as error:
        raise SystemExit(f"gpt-jax serve: {error}") from None
    return Channel()


@dataclasses.dataclass(frozen=True)
class Plan:
    """One program call, as process 0 made it, for the followers to make too."""

    program: str  # a PROGRAMS name, or "stop"
    recent_width: int = 0  # the engine state's recent-token window width before the call
    args: tuple = ()  # the call's arguments after (params, config, state), as host arrays
    static: dict = dataclasses.field(default_factory=dict)  # its keyword arguments


STOP = Plan("stop")


class _PlanUnpickler(pickle.Unpickler):
    """Plans only: numpy arrays and this project's dataclasses (the store is the job's,
    but a plan builds nothing else)."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] in ("numpy", "inference", "gpt_jax"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a plan holds no {module}.{name}")


def encode(plan: Plan) -> bytes:
    """A plan as bytes: pickled, compressed (the `[R, V]` prompt rows are mostly zeros)."""
    return zlib.compress(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL), 1)


def decode(data: bytes) -> Plan:
    return _PlanUnpickler(io.BytesIO(zlib.decompress(data))).load()


class Channel:
    """Plans from process 0 to the followers through the distributed client's key-value
    store: message k to follower p is key `PREFIX/p/k`, which p deletes once read."""

    def __init__(self):
        from jax._src.distributed import global_state

        self.client = global_state.client
        self.process, self.count = jax.process_index(), jax.process_count()
        self.sent = self.received = 0
        self.lock = threading.Lock()  # the engine thread plans, the main thread stops

    def send(self, plan: Plan) -> None:
        data = encode(plan)
        with self.lock:
            for follower in range(1, self.count):
                self.client.key_value_set_bytes(f"{PREFIX}/{follower}/{self.sent}", data)
            self.sent += 1

    def receive(self, timeout_ms: int = POLL_MS) -> Plan | None:
        """The next plan, or None when none came within `timeout_ms`."""
        key = f"{PREFIX}/{self.process}/{self.received}"
        try:
            data = self.client.blocking_key_value_get_bytes(key, timeout_ms)
        except jax.errors.JaxRuntimeError as error:
            if "DEADLINE_EXCEEDED" in str(error):
                return None
            raise
        self.client.key_value_delete(key)
        self.received += 1
        return decode(data)


def _fail(what: str, error: BaseException) -> None:
    distributed.exit_now(f"gpt-jax serve: process {jax.process_index()} of {jax.process_count()}: {what} "
             f"failed, another process has probably stopped; stopping: "
             f"{str(error).splitlines()[0] if str(error) else type(error).__name__}")


def _mirrored(name: str, program, channel: Channel):
    """`program` (an Engine program hook's signature), its call first sent as a Plan."""
    def run(params, config, state, *args, **static):
        try:
            channel.send(Plan(name, int(state.recent.shape[1]),
                              jax.tree.map(np.asarray, args), static))
            # waited for here (the engine reads the results next anyway), so that a failed
            # collective is reported as such, not later by whatever reads them
            return jax.block_until_ready(program(params, config, state, *args, **static))
        except jax.errors.JaxRuntimeError as error:  # a collective or the store
            _fail(f"the {name} step", error)
    return run


def lead(engine, channel: Channel) -> None:
    """Make process 0's `engine` send every program call to the followers before running
    it (`Engine.prefill_program`, `decode_program`), and refuse speculative requests,
    whose program is not sent. Raises ValueError for an engine with other programs
    attached (`inference.exported`)."""
    if engine.prefill_program is not None or engine.decode_program is not None:
        raise ValueError("a multi-process engine runs its jitted programs, not exported ones")
    engine.prefill_program = _mirrored("prefill", engine_prefill, channel)
    engine.decode_program = _mirrored("decode", engine_decode, channel)
    check = engine.check_request

    def check_request(request_id, prompt, sampling):
        prompt, sampling = check(request_id, prompt, sampling)
        if sampling.speculative is not None:
            raise RequestError("speculative", sampling.speculative, "null",
                               request=request_id, problem="{request}: {field}="
                               "{value!r} is not served across processes")
        return prompt, sampling

    engine.check_request = check_request


def follow(engine, channel: Channel) -> None:
    """A follower's loop: run each plan's program on `engine` (built as process 0's is)
    until the stop plan. A failed program or store ends the process with one line."""
    me = f"gpt-jax serve: process {jax.process_index()} of {jax.process_count()}"
    print(f"{me} runs process 0's programs (process 0 serves HTTP)", flush=True)
    while True:
        try:
            plan = channel.receive()
        except jax.errors.JaxRuntimeError as error:
            _fail("waiting for process 0's next step", error)
        if plan is None:
            continue
        if plan.program == STOP.program:
            print(f"{me}: process 0 stopped serving; exiting", flush=True)
            return
        engine.state = widen_recent(engine.state, plan.recent_width)
        args = to_device(plan.args)
        try:
            with engine.on_mesh():
                engine.state = jax.block_until_ready(PROGRAMS[plan.program](
                    engine.params, engine.config, engine.state, *args, **plan.static))
        except jax.errors.JaxRuntimeError as error:
            _fail(f"the {plan.program} step", error)
