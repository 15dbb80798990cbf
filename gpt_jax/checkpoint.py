"""Run directories: Orbax checkpoints plus the config and tokenizer files beside them.

Layout of a run directory:
  config.json        the GPTConfig
  train_config.json  the TrainConfig the run was started with
  tokenizer.json     the tokenizer
  metrics.jsonl      one JSON object per evaluation
  checkpoints/<step>/{params,opt_state,meta}   Orbax, written atomically, last k kept

Every file is written to a temporary name and renamed into place, and Orbax finalises a
checkpoint only once all of it is on disk, so a run killed at any moment leaves the previous
complete checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from gpt_jax.config import GPTConfig
from gpt_jax.tokenizer import CharTokenizer


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temporary file in the same directory, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_config(run_dir, config: GPTConfig) -> None:
    write_json_atomic(Path(run_dir) / "config.json", dataclasses.asdict(config))


def load_config(run_dir) -> GPTConfig:
    """Raises FileNotFoundError naming the run directory when it has no config.json."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory: {path} does not exist")
    return GPTConfig(**json.loads(path.read_text()))


def save_tokenizer(run_dir, tokenizer) -> None:
    path = Path(run_dir) / "tokenizer.json"
    tmp = path.with_suffix(".json.tmp")
    tokenizer.save(tmp)
    os.replace(tmp, path)


def load_tokenizer(run_dir) -> CharTokenizer:
    return CharTokenizer.load(Path(run_dir) / "tokenizer.json")


def manager(run_dir, keep: int = 3) -> ocp.CheckpointManager:
    """An Orbax manager over `run_dir/checkpoints` keeping the last `keep` checkpoints."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(
        Path(run_dir).absolute() / "checkpoints", options=options,
        item_names=("params", "opt_state", "meta"),
    )


def save(mngr: ocp.CheckpointManager, step: int, params, opt_state, meta: dict) -> None:
    """Save params, optimizer state and JSON metadata (step, data position) at `step`."""
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta),
    ))
    mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, step: int, params_like, opt_state_like):
    """Restore `(params, opt_state, meta)` at `step` into the structure of the given trees."""
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
    out = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract(params_like)),
        opt_state=ocp.args.StandardRestore(abstract(opt_state_like)),
        meta=ocp.args.JsonRestore(),
    ))
    return out.params, out.opt_state, out.meta


def load_params(run_dir, step: int | None = None):
    """`(config, params, tokenizer)` of a run, from its latest (or given) checkpoint.

    Raises:
      FileNotFoundError: the directory has no config or no checkpoint.
    """
    config = load_config(run_dir)
    mngr = manager(run_dir)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint under checkpoints/")
    params = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore())).params
    return config, params, load_tokenizer(run_dir)
