r"""`gpt-jax export --format onnx`: the model's step (`inference.onnx_forward.step`: new
tokens with a dense past KV cache in, logits and the present cache out) as an ONNX file
for ONNX Runtime, TensorRT and the other runtimes that take ONNX, converted by `jax2onnx`.

Usage:
  gpt-jax export --format onnx --run-dir runs/shakespeare-char --out char.onnx
  gpt-jax export --format onnx --hf-checkpoint DIR --out gpt2.onnx
  python inference/onnx_runner.py gpt2.onnx --prompt "Hello" --max-new-tokens 32

Writes OUT (the graph, opset `OPSET`, the weights as initializers; past `EXTERNAL_OVER`
bytes of weights, which a protobuf file cannot hold, they go to OUT.data beside it as ONNX
external data), the tokenizer copies as `gpt-jax export` makes them (OUT.tokenizer.json, or
OUT.vocab.json + OUT.merges.txt), and last OUT.json: the signature, the model's config,
the EOS ids and the tokenizer. Batch, new-token and past axes are dynamic (B, T, P in the
graph's input shapes); float32. Each file is written under a temporary name and renamed:
a killed export leaves whole files or none.

The graph holds only standard ONNX operators (the default domain): the step is traced on
XLA's portable path, with no CPU kernel's custom call (`gpt_jax.kernels.portable`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt_jax import checkpoint, kernels
from gpt_jax.config import GPTConfig
from gpt_jax.params import check_params, param_count
from inference import onnx_forward

OPSET = 21  # ONNX opset of the graph: Gelu (opset 20) is one op; TensorRT 10 parses it
EXTERNAL_OVER = 2_000_000_000  # weight bytes past which they go to OUT.data (protobuf: 2 GiB)
# input_ids, attention_mask and position_ids: int32, where Optimum has int64 (TensorRT's
# native index type is int32; the runner feeds it)
INDEX_DTYPE = "int32"

# The signature: (name pattern, dtype, axes, meaning). B batch, T new tokens, P past length,
# K kv heads, H head dim, V vocab; l a layer.
INPUTS = (
    ("input_ids", INDEX_DTYPE, "BT", "the new token ids (clamped to [0, vocab_size))"),
    ("attention_mask", INDEX_DTYPE, ("B", "P + T"),
     "1 for a real token, 0 for padding, over the past and the new tokens"),
    ("position_ids", INDEX_DTYPE, "BT", "each new token's position in its own sequence "
                                        "(its count of real tokens before it)"),
    ("past_key_values.{l}.key", "float32", "BKPH",
     "layer l's cached keys (rotary: rotated at their positions); P = 0 at prefill"),
    ("past_key_values.{l}.value", "float32", "BKPH", "layer l's cached values"),
)
OUTPUTS = (
    ("logits", "float32", "BTV", "next-token logits of each new token"),
    ("present.{l}.key", "float32", ("B", "K", "P + T", "H"), "the past keys, then the new"),
    ("present.{l}.value", "float32", ("B", "K", "P + T", "H"), "the past values, then the new"),
)


def input_specs(config: GPTConfig) -> list[jax.ShapeDtypeStruct]:
    """The step's inputs as shapes with symbolic B, T, P (one scope: P + T is the sum)."""
    scope = jax.export.SymbolicScope()
    K, H = config.kv_heads, config.head_dim

    def spec(dims: str, dtype):
        return jax.ShapeDtypeStruct(jax.export.symbolic_shape(dims, scope=scope), dtype)

    index = jnp.dtype(INDEX_DTYPE)
    past = [spec(f"B, {K}, P, {H}", jnp.float32) for _ in range(2 * config.n_layers)]
    return [spec("B, T", index), spec("B, P + T", index), spec("B, T", index), *past]


def export_onnx(params, config: GPTConfig):
    """Convert the step (`inference.onnx_forward.step`, `params` in the graph as float32
    initializers) with jax2onnx, traced inside `gpt_jax.kernels.portable()`.

    Returns:
      the graph as an `onnx_ir.Model` (`onnx_ir.to_proto` gives the `onnx.ModelProto`).
    Raises:
      ValueError: params that do not match `config` (`gpt_jax.params.check_params`),
        before anything is traced.
    """
    import jax2onnx  # the onnx extra: only this command needs it

    check_params(params, config)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    fn = functools.partial(onnx_forward.step, params, config)
    # jax2onnx imports a plugin for every library it converts from; those for libraries
    # not installed here (equinox, dm_pix) each log a warning with a traceback
    with _quiet("jax2onnx.plugins.plugin_system"), kernels.portable():
        return jax2onnx.to_onnx(fn, input_specs(config), model_name="gpt_jax_step",
                                opset=OPSET, return_mode="ir",
                                input_names=onnx_forward.input_names(config),
                                output_names=onnx_forward.output_names(config))


@contextlib.contextmanager
def _quiet(logger: str):
    """The named logger's warnings dropped within the block (its errors kept)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def weight_bytes(model) -> int:
    """Bytes of the graph's initializers (its weights)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.const_value is not None)


def describe(config: GPTConfig, *, program: str, data: str | None, eos_token_ids,
             source: str, tokenizer: dict | None) -> dict:
    """The JSON written beside the graph: how to run it, its signature, what it holds."""
    size = {"K": config.kv_heads, "H": config.head_dim, "V": config.vocab_size}

    def args(table):
        return [{"name": name, "dtype": dtype, "meaning": meaning,
                 "shape": [size.get(a, a) for a in axes], "per_layer": "{l}" in name}
                for name, dtype, axes, meaning in table]

    return {
        "format": "onnx", "program": program, "external_data": data, "opset": OPSET,
        "load": "onnxruntime.InferenceSession(program) (external data, when there is, is "
                "read from beside it)",
        "loop": "prefill: the prompts left-padded (attention_mask 0 on padding, position_ids "
                "counting real tokens), past of length 0; then one token per call, present "
                "fed back as past and attention_mask grown by a 1 (inference/onnx_runner.py)",
        "inputs": args(INPUTS), "outputs": args(OUTPUTS),
        "n_layers": config.n_layers, "max_seq_len": config.max_seq_len,
        "eos_token_ids": list(eos_token_ids),
        "attention": "XLA's portable path (gpt_jax.kernels.portable): standard ONNX operators",
        "model": {"source": source, "dtype": "float32", "config": config.to_dict()},
        "tokenizer": tokenizer,
    }


def write_graph(model, out: Path, external_over: int = EXTERNAL_OVER) -> str | None:
    """Write the graph at `out`, its weights in OUT.data when they exceed `external_over`
    bytes: both saved in a temporary folder beside `out`, then renamed into place (the data
    first). Returns the data file's name, or None."""
    import onnx_ir

    data = f"{out.name}.data" if weight_bytes(model) > external_over else None
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # onnx_ir warns of each intermediate shape value jax2onnx left untyped: not written,
        # and nothing reads them
        with _quiet("onnx_ir.serde"):
            onnx_ir.save(model, folder / out.name, external_data=data)
        if data:
            os.replace(folder / data, out.with_name(data))
        os.replace(folder / out.name, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return data


def write_onnx(model, out, config: GPTConfig, *, eos_token_ids, source: str,
               tokenizer_note, external_over: int = EXTERNAL_OVER) -> dict:
    """Write OUT (`write_graph`) and last OUT.json (`describe`); `tokenizer_note` writes the
    tokenizer copies beside OUT and returns their note (`inference.export.copy_tokenizer`).
    Returns the description."""
    out = Path(out)
    data = write_graph(model, out, external_over)
    description = describe(config, program=out.name, data=data, eos_token_ids=eos_token_ids,
                           source=source, tokenizer=tokenizer_note(out))
    checkpoint.write_json_atomic(out.with_name(f"{out.name}.json"), description)
    return description


def summary(out: Path, description: dict, params) -> str:
    """The line `gpt-jax export --format onnx` prints."""
    files = [out] + ([out.with_name(description["external_data"])]
                     if description["external_data"] else [])
    size = sum(f.stat().st_size for f in files)
    return (f"wrote {', '.join(map(str, files))} ({size:,} bytes; {param_count(params):,} "
            f"parameters, float32, opset {OPSET}) and {out}.json: dynamic batch and "
            f"sequence axes, EOS ids {description['eos_token_ids']}, tokenizer "
            f"{(description['tokenizer'] or {}).get('files')}")

