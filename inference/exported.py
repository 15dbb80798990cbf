"""The engine's programs kept as `jax.export` artifacts beside the compilation cache, so a warm
start skips tracing and lowering the engine's Python.

With the persistent compilation cache alone (`inference.compile_cache`), a start still traces
and lowers every program to find its cache entry: most of a warm start (measured in
benchmarks/README.md, "Start-up"). `ExportedPrograms.wrap` runs a jitted entry point
(`engine_prefill`, `engine_decode`, `engine_mixed`) through `jax.export` instead: the first
call of each shape exports it (the CPU kernels' custom calls kept: reading an artifact
registers the kernels it calls) and writes the serialized artifact; a later process
deserializes it and lowers only the call, whose XLA program then comes from the cache.
Results equal the jitted function's: the same StableHLO runs.

An artifact is found by a SHA-256 of the entry point's name, its static arguments, the tree,
shapes and dtypes of the others, the source of gpt_jax and inference (a changed line
exports anew), `XLA_FLAGS` and the backend; its directory is already keyed by the jax
version, the kernels' source and the CPU (`compile_cache.key_dir`). Each file starts with
the SHA-256 of the rest: one that does not match (truncated, corrupt) or does not
deserialize is removed with a warning and exported again, never a crash. Files are written
to a temporary name and renamed into place.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from gpt_jax.kernels import causal_attention, few_rows_matmul, paged_attention, panel_matmul
from inference import compile_cache
from inference.batching import engine_decode, engine_prefill
from inference.mixed import engine_mixed

PACKAGES = ("gpt_jax", "inference")  # whose source keys every artifact
# The CPU kernels' FFI targets, and what registers each (tracing a program registers the
# kernels it calls; a deserialized program was not traced here).
KERNELS = {paged_attention.TARGET: paged_attention.available,
           panel_matmul.TARGET: panel_matmul.available,
           panel_matmul.F32_TARGET: panel_matmul.available,
           few_rows_matmul.TARGET: few_rows_matmul.available,
           causal_attention.FORWARD: causal_attention.available,
           causal_attention.BACKWARD: causal_attention.available}
# jax.export refuses a custom call unless told the loading process will have it.
KERNEL_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNELS]


def source_digest() -> str:
    """SHA-256 of every .py, .cc and .h file of `PACKAGES` (paths and text)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cc", ".h"):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class ExportedPrograms:
    """The artifacts in `directory`, and the programs of this process, by call shape.

    `loaded` and `exported` count the artifacts read and written."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.base = "\0".join([source_digest(), os.environ.get("XLA_FLAGS", ""),
                               jax.default_backend(), jax.devices()[0].device_kind])
        self.programs: dict = {}  # call key -> (jitted exported call, output tree)
        self.loaded = self.exported = 0

    def wrap(self, fn, static: tuple[str, ...], donate: str) -> Callable:
        """A function called as `fn` is (same arguments, same result) that runs the exported
        program of each call shape. `fn` is a `jax.jit` function whose `static` arguments
        are hashable and whose result has the tree of its `donate` argument (donated)."""
        signature = inspect.signature(fn)

        def program(args, kwargs):
            """The call's program (read, or exported, once per call shape) and its leaves."""
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            statics = tuple((k, bound.arguments[k]) for k in static)
            names = [k for k in bound.arguments if k not in static]
            dynamic = [bound.arguments[k] for k in names]
            leaves, tree = jax.tree.flatten(dynamic)
            key = (fn.__name__, statics, tree,
                   tuple((np.shape(x), np.dtype(x.dtype).name) for x in leaves))
            if key not in self.programs:
                self.programs[key] = self._program(fn, key, names, dynamic, donate)
            return self.programs[key], leaves

        def call(*args, **kwargs):
            (jitted, out_tree), leaves = program(args, kwargs)
            return jax.tree.unflatten(out_tree, jitted(*leaves))

        def precompile(*args, **kwargs) -> Callable[[], None]:
            """Read (or export) the program of this call's shape now, in this thread; returns
            what compiles its call, or loads it from the compilation cache, without running
            it: XLA compiles outside the GIL, so `warmup.compile_all` runs several at once.
            The arguments may be numpy arrays: only shapes and dtypes count."""
            (jitted, _), leaves = program(args, kwargs)

            def compile_call() -> None:
                jitted.lower(*leaves).compile()  # kept by jit: its first call runs it
            return compile_call

        call.precompile = precompile
        return call

    def _program(self, fn, key, names: list[str], dynamic: list, donate: str):
        """The jitted call of `fn`'s exported program for `key` (`dynamic`: the values of
        the arguments `names`), and its output tree: read from its artifact, or exported and
        written."""
        statics, tree, donated = dict(key[1]), key[2], names.index(donate)
        path = self.directory / (hashlib.sha256(
            f"{self.base}\0{key!r}".encode()).hexdigest()[:32] + ".jaxexport")
        exported = self._read(path)
        if exported is None:
            def flat(*leaves):
                values = jax.tree.unflatten(tree, leaves)
                return jax.tree.leaves(fn(**dict(zip(names, values)), **statics))
            exported = jax.export.export(jax.jit(flat), disabled_checks=KERNEL_CHECKS)(
                *jax.tree.leaves(dynamic))
            self._write(path, exported.serialize())
        before = sum(len(jax.tree.leaves(a)) for a in dynamic[:donated])
        donate = tuple(range(before, before + len(jax.tree.leaves(dynamic[donated]))))
        return (jax.jit(exported.call, donate_argnums=donate),
                jax.tree.structure(dynamic[donated]))

    def _read(self, path: Path):
        """The artifact at `path`, None when there is none; a broken one is removed with a
        warning."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if hashlib.sha256(data[32:]).digest() != data[:32]:
                raise ValueError("its checksum does not match (truncated or corrupt)")
            exported = jax.export.deserialize(bytearray(data[32:]))
        except Exception as error:  # noqa: BLE001: any failure to read is a broken artifact
            compile_cache.drop_broken(path, "the exported program", error,
                                      "it will be exported again", stacklevel=3)
            return None
        for target, register in KERNELS.items():  # before XLA loads the program
            if target.encode() in exported.mlir_module_serialized:
                register()
        self.loaded += 1
        return exported

    def _write(self, path: Path, blob: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(hashlib.sha256(blob).digest() + blob)
        os.replace(tmp, path)  # whole or absent, for a concurrent reader too
        self.exported += 1


def attach(engine, directory: Path) -> ExportedPrograms:
    """Make `engine` (an `inference.Engine`) run its prefill, decode and mixed programs
    exported, with the artifacts in `directory`. Returns the programs (their counts).

    The engine's state is committed to its device here: every program's output is, so the
    state a program gets is then always committed, and a program compiled ahead
    (`precompile`) for it is the one its calls find (jit keys a program by its arguments'
    placement too: compiled for the fresh, uncommitted state, the decode chunk after a
    prefill was lowered and loaded again)."""
    engine.state = jax.device_put(engine.state, jax.devices()[0])
    programs = ExportedPrograms(directory)
    engine.prefill_program = programs.wrap(engine_prefill, ("config", "pad_id"), "state")
    engine.decode_program = programs.wrap(engine_decode, ("config", "n_rows", "pad_id"),
                                          "state")
    engine.mixed_program = programs.wrap(engine_mixed, ("config", "n_rows", "pad_id"),
                                         "state")
    return programs
