r"""`gpt-jax export`: the whole generation program, weights inside, as one `jax.export` file
that a process with only jax (and flatbuffers, which jax's deserializer needs) loads and
runs, without this package.

Usage:
  gpt-jax export --run-dir runs/shakespeare-char --out char.jaxexport --batch 4 \
      --prompt-len 16 --max-new-tokens 48
  gpt-jax export --hf-checkpoint DIR --out gpt2.jaxexport --batch 1 --prompt-len 64 \
      --max-new-tokens 128 --platforms cpu,cuda

Writes OUT (`jax.export.Exported.serialize()`: StableHLO, the weights as constants), OUT.json
(the call signature, shapes, platforms, EOS id, the model and the tokenizer file) and, when
the model has a tokenizer, a copy of it beside them: OUT.tokenizer.json (a run's
`tokenizer.json` or a Hugging Face `tokenizer.json`), or OUT.vocab.json + OUT.merges.txt.
Each file is written to a temporary name and renamed into place: a killed export leaves
whole files or none.

The call, fixed (B, T, max_new_tokens: the exported --batch, --prompt-len,
--max-new-tokens):

  exported.call(tokens_BT int32[B, T], lengths_B int32[B], temperature_B float32[B],
                top_p_B float32[B], seed_B uint32[B])
      -> (output_tokens int32[B, max_new_tokens], num_tokens_B int32[B])

Prompts are right-padded (what lies past a row's length is ignored; ids outside
[0, vocab_size) are clamped to it, a negative one to 0); temperature 0 is greedy; a row
stops after the model's EOS id (kept and counted) when it has one, else after
max_new_tokens tokens; `output_tokens[b, :num_tokens_B[b]]` is row b's output, 0 after it.
The program is `inference.generation.generation` (prefill, the `lax.scan` decode loop in a
`lax.while_loop`, sampling, EOS stop) on those inputs, so a row's tokens equal
`inference.generate`'s for the same prompt, temperature, top_p, seed and max_new_tokens (up
to float rounding: XLA's attention runs here, the CPU kernel there); the prompt's hash that
keys a row's noise is computed in the graph (`inference.sampling.prompt_hashes`). Another
batch or prompt length is another export: shapes are fixed, and a call with others fails
with jax's shape error.

The attention is XLA's portable path (`gpt_jax.kernels.portable`): the CPU kernel is a
custom call registered only in a process that imported gpt_jax.

`--format onnx` writes instead the model's step with a dense KV cache as an ONNX graph,
dynamic batch and sequence axes (`inference.onnx_export`, run by inference/onnx_runner.py).
An --out in a folder that does not exist is refused, for both formats.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import checkpoint, kernels
from gpt_jax.config import GPTConfig
from gpt_jax.params import check_params, decode_layout, param_count
from inference import onnx_export, stopping
from inference.generation import generation
from inference.load import add_model_args, load_config, load_model
from inference.sampling import SamplingArrays, prompt_hashes
from inference.steps import cached_model

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what jax.export lowers for
PAD_ID = 0  # the prompt padding fed to the model, and the token after a row's output
TOKENIZER_HOW = {  # how a process without gpt_jax reads each kind of tokenizer copy
    "char": 'gpt-jax\'s char tokenizer, {"kind": "char", "chars": [...]}: token id i is chars[i]',
    "bpe": "byte-level BPE in the tokenizers format: tokenizers.Tokenizer.from_file(file)",
    "vocab": "byte-level BPE: tokenizers.models.BPE.from_file(vocab, merges) with a "
             "ByteLevel pre-tokenizer and decoder",
}

# The call signature: (name, dtype, axes, meaning). B batch, T prompt length, and
# max_new_tokens in words.
INPUTS = (
    ("tokens_BT", "int32", "BT", "prompt token ids, right-padded (ids in [0, vocab_size), "
                                 "others clamped to it; anything past a row's length is "
                                 "ignored)"),
    ("lengths_B", "int32", "B", "real tokens of each prompt, in [1, T] (clipped to it)"),
    ("temperature_B", "float32", "B", "0 = greedy; otherwise logits are divided by it"),
    ("top_p_B", "float32", "B", "nucleus sampling: keep the smallest set of tokens whose "
                                "probability reaches top_p; 1 = off"),
    ("seed_B", "uint32", "B", "each row's seed: the same seed and prompt repeat exactly"),
)
OUTPUTS = (
    ("output_tokens", "int32", ("B", "max_new_tokens"),
     "generated token ids; row b's are its first num_tokens_B[b], then 0"),
    ("num_tokens_B", "int32", "B", "tokens generated per row (an EOS that ended the row "
                                   "counted), at most max_new_tokens"),
)


def check_shape(config: GPTConfig, batch, prompt_len, max_new_tokens, platforms=("cpu",),
                eos_token_id=None, flags: bool = False) -> None:
    """Check an export's shapes against the model before any work.

    Raises:
      ValueError: batch, prompt_len or max_new_tokens not an int >= 1; prompt_len +
        max_new_tokens over config.max_seq_len; a platform not in PLATFORMS, or one given
        twice; an EOS id outside the vocabulary. The message names the value and what is
        allowed, as the parameter (`batch=0`), or with `flags` as `gpt-jax export`'s flag
        (`--batch 0`).
    """
    def named(name: str, value) -> str:
        return f"--{name.replace('_', '-')} {value}" if flags else f"{name}={value}"

    for name, value in (("batch", batch), ("prompt_len", prompt_len),
                        ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{named(name, repr(value))} is out of range; allowed: an int >= 1")
    if prompt_len + max_new_tokens > config.max_seq_len:
        sum_of = (f"--prompt-len {prompt_len} + --max-new-tokens {max_new_tokens}" if flags
                  else f"prompt_len {prompt_len} + max_new_tokens {max_new_tokens}")
        raise ValueError(
            f"{sum_of} = {prompt_len + max_new_tokens} exceeds the model's max_seq_len "
            f"{config.max_seq_len}; allowed: a sum of at most {config.max_seq_len}")
    platforms = tuple(platforms)
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms or len(set(platforms)) != len(platforms):
        raise ValueError(f"{named('platforms', repr(','.join(platforms)))} is not allowed; "
                         f"allowed: one or more of {', '.join(PLATFORMS)}, each once")
    if any(not 0 <= i < config.vocab_size for i in eos_ids(eos_token_id)):
        raise ValueError(f"eos_token_id={eos_token_id} is outside the vocabulary; allowed: "
                         f"None or ids in [0, {config.vocab_size})")


def eos_ids(eos_token_id) -> tuple[int, ...]:
    """An export's EOS setting (None, one id, or a list of ids: a Hugging Face directory
    may name several) as the tuple of ids that each stop a row."""
    if eos_token_id is None:
        return ()
    return tuple(int(i) for i in (eos_token_id if isinstance(eos_token_id, (list, tuple))
                                  else [eos_token_id]))


def generation_fn(params, config: GPTConfig, *, batch: int, max_new_tokens: int,
                  eos_token_id=None, cache_dtype=jnp.float32):
    """The function `export_generate` exports: `(tokens_BT, lengths_B, temperature_B,
    top_p_B, seed_B) -> (output_tokens, num_tokens_B)` (see INPUTS, OUTPUTS), with `params`
    (cast to `cache_dtype`, in the decode layout) closed over as constants. It runs
    `inference.generation.generation` with the rows' sampling arrays built from its inputs:
    every other sampling option off, EOS the only stop, `max_new_tokens` for every row."""
    params = jax.jit(decode_layout)(jax.tree.map(lambda a: a.astype(cache_dtype), params))
    eos = eos_ids(eos_token_id)
    # Constant arrays, made here: made inside the trace they would be traced values.
    defaults = SamplingArrays.of_defaults(batch, config.vocab_size)
    stops = stopping.StopArrays.from_lists([max_new_tokens] * batch, [eos] * batch,
                                           [()] * batch)

    def generate_tokens(tokens_BT, lengths_B, temperature_B, top_p_B, seed_B):
        T = tokens_BT.shape[1]
        lengths_B = jnp.clip(lengths_B, 1, T)
        real_BT = jnp.arange(T)[None, :] < lengths_B[:, None]
        # clamped on both sides before anything reads them (a gather wraps a negative id:
        # -5 would run as V-5), the prompt's hash included; a program cannot raise
        tokens_BT = jnp.clip(tokens_BT, 0, config.vocab_size - 1)
        tokens_BT = jnp.where(real_BT, tokens_BT, PAD_ID)  # as generate pads
        rows = defaults.replace(temperature=temperature_B, top_p=top_p_B, seed=seed_B,
                                prompt_hash=prompt_hashes(tokens_BT, lengths_B, jnp))
        state = generation(params, config, tokens_BT, lengths_B,
                           jnp.arange(batch, dtype=jnp.int32), rows, stops,
                           capacity=T + max_new_tokens, n_steps=max_new_tokens, n_top=0,
                           model_fns=cached_model, cache_dtype=cache_dtype, pad_id=PAD_ID,
                           forked=False)
        return state.tokens, state.num_tokens

    return generate_tokens


def input_specs(batch: int, prompt_len: int) -> list[jax.ShapeDtypeStruct]:
    """The exported call's argument shapes and dtypes, in order."""
    size = {"B": batch, "T": prompt_len}
    return [jax.ShapeDtypeStruct(tuple(size[a] for a in axes), np.dtype(dtype))
            for _, dtype, axes, _ in INPUTS]


def export_generate(params, config: GPTConfig, *, batch: int, prompt_len: int,
                    max_new_tokens: int, eos_token_id: int | None = None,
                    platforms=None, cache_dtype=jnp.float32) -> jax.export.Exported:
    """Export the generation program for `batch` prompts of `prompt_len` tokens and
    `max_new_tokens` new tokens, lowered for each of `platforms` (default: this process's
    backend), XLA's attention path traced (`gpt_jax.kernels.portable`).

    Returns:
      a `jax.export.Exported`; `.serialize()` gives the file's bytes, `.call(...)` runs it
      (see the module docstring for the signature).
    Raises:
      ValueError: a shape or platform `check_shape` refuses, or params that do not match
        `config` (`gpt_jax.params.check_params`); both before anything is traced.
    """
    platforms = tuple(platforms or (jax.default_backend(),))
    check_shape(config, batch, prompt_len, max_new_tokens, platforms, eos_token_id)
    check_params(params, config)
    fn = generation_fn(params, config, batch=batch, max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, cache_dtype=cache_dtype)
    # A fresh jit of a fresh function: traced now, inside portable(), never a cached trace.
    with kernels.portable():
        return jax.export.export(jax.jit(fn), platforms=platforms)(
            *input_specs(batch, prompt_len))


def describe(exported: jax.export.Exported, config: GPTConfig, *, program: str,
             eos_token_id, source: str, dtype: str, tokenizer: dict | None) -> dict:
    """The JSON written beside the program: how to load and call it, and what it holds."""
    B, T = exported.in_avals[0].shape
    max_new_tokens = exported.out_avals[0].shape[1]
    size = {"B": B, "T": T, "max_new_tokens": max_new_tokens}

    def args(table):
        return [{"name": name, "dtype": dtype, "shape": [size[a] for a in axes],
                 "meaning": meaning} for name, dtype, axes, meaning in table]

    return {
        "program": program,
        "load": "jax.export.deserialize(bytearray(open(program, 'rb').read())) (needs jax "
                "and flatbuffers)",
        "call": "exported.call(tokens_BT, lengths_B, temperature_B, top_p_B, seed_B) -> "
                "(output_tokens, num_tokens_B)",
        "inputs": args(INPUTS),
        "outputs": args(OUTPUTS),
        "batch": B, "prompt_len": T, "max_new_tokens": max_new_tokens,
        "eos_token_id": eos_token_id,
        "stop": ("after the EOS id (kept and counted in num_tokens_B)" if eos_token_id
                 is not None else "after max_new_tokens (the model has no EOS id)"),
        "platforms": list(exported.platforms),
        "jax_version": jax.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "attention": "XLA's portable path (gpt_jax.kernels.portable), not the CPU kernel",
        "seeds": "a row's key: fold_in(fold_in(fold_in(key(seed), prompt_hash), 0), step), "
                 "prompt_hash computed in the graph as inference.sampling.prompt_hashes: "
                 "the same tokens as inference.generate for the same request",
        "model": {"source": source, "dtype": dtype, "config": dataclasses.asdict(config)},
        "tokenizer": tokenizer,
    }


def _write_bytes(tmp: Path, data: bytes) -> None:
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def tokenizer_files(args) -> dict[str, Path]:
    """The model's tokenizer files by the suffix their copies get (`tokenizer.json`, or
    `vocab.json` + `merges.txt`); empty when it has none."""
    if not args.hf_checkpoint:
        return {"tokenizer.json": Path(args.run_dir) / "tokenizer.json"}
    folder = Path(args.hf_checkpoint)
    if (folder / "tokenizer.json").exists():
        return {"tokenizer.json": folder / "tokenizer.json"}
    if (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
        return {"vocab.json": folder / "vocab.json", "merges.txt": folder / "merges.txt"}
    return {}


def copy_tokenizer(out: Path, tokenizer: dict[str, Path],
                   tokenizer_kind: str | None = None) -> dict | None:
    """Copy the tokenizer files (`tokenizer`: suffix -> file, `tokenizer_files`) beside
    `out` as OUT.<suffix>, each atomically. Returns the description's note on them (files,
    kind, how to read them), or None when there are none."""
    copies = []
    for suffix, source_path in tokenizer.items():
        copy = out.with_name(f"{out.name}.{suffix}")
        checkpoint.write_atomic(copy, lambda tmp, s=source_path: shutil.copyfile(s, tmp))
        copies.append(copy.name)
    return {"files": copies, "kind": tokenizer_kind,
            "how": TOKENIZER_HOW["char" if tokenizer_kind == "char" else
                                 "bpe" if "tokenizer.json" in tokenizer else "vocab"]
            } if copies else None


def write_export(exported: jax.export.Exported, out, config: GPTConfig, *, eos_token_id,
                 source: str, dtype: str, tokenizer: dict[str, Path],
                 tokenizer_kind: str | None = None) -> dict:
    """Write OUT (the serialized program), the tokenizer copies OUT.<suffix>
    (`copy_tokenizer`), and last OUT.json (`describe`), each atomically. Returns the
    description."""
    out = Path(out)
    checkpoint.write_atomic(out, lambda tmp: _write_bytes(tmp, exported.serialize()))
    note = copy_tokenizer(out, tokenizer, tokenizer_kind)
    description = describe(exported, config, program=out.name, eos_token_id=eos_token_id,
                           source=source, dtype=dtype, tokenizer=note)
    checkpoint.write_atomic(out.with_name(f"{out.name}.json"),
                  lambda tmp: _write_bytes(tmp, json.dumps(description, indent=2).encode()))
    return description


FORMATS = ("jax", "onnx")  # --format: a jax.export program; the ONNX step (inference.onnx_export)
JAX_ONLY = ("batch", "prompt_len", "max_new_tokens", "platforms")  # --format jax's shape flags


def parse_args(argv=None):
    """The flags; `--format onnx` refuses the jax program's shape flags and a --dtype other
    than float32, `--format jax` requires --batch, --prompt-len and --max-new-tokens
    (argparse errors, before any work)."""
    p = argparse.ArgumentParser(prog="gpt-jax export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, quantize=False)  # the exported weights are float (--dtype); int8 is not
    p.add_argument("--out", required=True, metavar="FILE", help="the program's file")
    p.add_argument("--format", choices=FORMATS, default="jax",
                   help="jax: the whole generation program as one jax.export file (fixed "
                        "shapes); onnx: the model's step with a dense KV cache as inputs and "
                        "outputs, dynamic batch and sequence axes (inference.onnx_export)")
    p.add_argument("--batch", type=int, metavar="B", help="prompts per call (jax)")
    p.add_argument("--prompt-len", type=int, metavar="T",
                   help="prompt tokens per row, right-padded (jax)")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="tokens generated per row, fewer when a row ends at EOS (jax)")
    p.add_argument("--platforms", default=None, metavar="LIST",
                   help=f"comma-separated, from {','.join(PLATFORMS)} (default: this "
                        "machine's backend); lowered for each, for the loader to pick (jax)")
    args = p.parse_args(argv)
    flags = {name: "--" + name.replace("_", "-") for name in JAX_ONLY}
    if args.format == "jax":
        missing = [flags[n] for n in JAX_ONLY[:3] if getattr(args, n) is None]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    else:
        given = [flags[n] for n in JAX_ONLY if getattr(args, n) is not None]
        if given:
            p.error(f"{', '.join(given)}: --format jax only; an ONNX graph's batch and "
                    "sequence axes are dynamic")
        if args.dtype != "float32":
            p.error(f"--dtype {args.dtype}: --format onnx exports float32; allowed: float32")
    return args


def check_out(out: Path) -> None:
    """Raise ValueError, before any work, when the files could not be written at `out`: it
    is a directory, its folder does not exist (no folder is created), or that folder is not
    one this process may write in."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; allowed: a file path (its "
                         "description and tokenizer go beside it)")
    folder = parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a directory; allowed: a "
                         "path under a writable directory")
    if parent != folder:
        raise ValueError(f"--out {out}: the folder {folder} does not exist; allowed: a path "
                         "in an existing, writable directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: the directory {parent} is not writable; allowed: a "
                         "path under a writable directory")


def main(argv=None):
    """`gpt-jax export`: check every flag (sizes, platforms, the model's context) before
    loading the weights, then export and write. Bad input exits with a one-line message."""
    args = parse_args(argv)
    if args.format == "onnx":
        return main_onnx(args)
    platforms = (jax.default_backend(),) if args.platforms is None else \
        tuple(args.platforms.split(","))  # "" is refused by check_shape, not the default
    try:
        check_out(Path(args.out))
        config = load_config(args)  # the config alone: shapes are checked before the weights
        check_shape(config, args.batch, args.prompt_len, args.max_new_tokens, platforms,
                    flags=True)
        params, config, tokenizer, eos = load_model(args)
        eos_token_id = eos[0] if len(eos) == 1 else list(eos) or None  # as config.json says
        exported = export_generate(
            params, config, batch=args.batch, prompt_len=args.prompt_len,
            max_new_tokens=args.max_new_tokens, eos_token_id=eos_token_id,
            platforms=platforms, cache_dtype=jnp.dtype(args.dtype))
    except (ValueError, OSError, ImportError) as error:  # ImportError: a .bin without torch
        raise SystemExit(f"gpt-jax export: {error}") from None
    source = args.hf_checkpoint or args.run_dir
    try:
        description = write_export(exported, args.out, config, eos_token_id=eos_token_id,
                                   source=str(source), dtype=args.dtype,
                                   tokenizer=tokenizer_files(args),
                                   tokenizer_kind=getattr(tokenizer, "kind", None))
    except OSError as error:  # each file is written atomically: none is left half-written
        raise SystemExit(f"gpt-jax export: cannot write --out {args.out}: {error}") from None
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out} ({size:,} bytes; {param_count(params):,} parameters, "
          f"{args.dtype}) and {args.out}.json: batch {args.batch}, prompt_len "
          f"{args.prompt_len}, max_new_tokens {args.max_new_tokens}, platforms "
          f"{','.join(description['platforms'])}, EOS id {eos_token_id}, tokenizer "
          f"{(description['tokenizer'] or {}).get('files')}")


def main_onnx(args) -> None:
    """`gpt-jax export --format onnx` on flags `parse_args` has checked: --out checked and
    the converter found before the weights are read, then export (`inference.onnx_export`)
    and write. Bad input exits with a one-line message."""
    out = Path(args.out)
    try:
        check_out(out)
        load_config(args)  # a missing or broken run is refused before the weights are read
        if importlib.util.find_spec("jax2onnx") is None:
            raise ValueError("--format onnx needs jax2onnx, onnx and onnxruntime (README, "
                             "\"Export to ONNX\")")
        params, config, tokenizer, eos = load_model(args)
        model = onnx_export.export_onnx(params, config)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"gpt-jax export: {error}") from None
    note = functools.partial(copy_tokenizer, tokenizer=tokenizer_files(args),
                             tokenizer_kind=getattr(tokenizer, "kind", None))
    try:
        description = onnx_export.write_onnx(model, out, config, eos_token_ids=eos,
                                             source=str(args.hf_checkpoint or args.run_dir),
                                             tokenizer_note=note)
    except OSError as error:  # each file is written atomically: none is left half-written
        raise SystemExit(f"gpt-jax export: cannot write --out {out}: {error}") from None
    print(onnx_export.summary(out, description, params))


if __name__ == "__main__":
    main()
