"""Run directories: Orbax checkpoints plus the config and tokenizer files beside them.

Layout of a run directory:
  config.json        the GPTConfig
  train_config.json  the TrainConfig the run was started with
  tokenizer.json     the tokenizer (char-level JSON, or the `tokenizers` BPE format)
  metrics.jsonl      one JSON object per evaluation
  loss.png           train and val loss against step and against wall time
  checkpoints/<step>/{params,opt_state,meta,metrics}   Orbax, written atomically; the
                     last k and the one with the lowest val loss (metrics) are kept, also
                     across resumes
  checkpoints/<step>/files.sha256.json   the digest of every file above

Every file is written to a temporary name and renamed into place, and Orbax finalises a
checkpoint only once all of it is on disk, so a run killed at any moment leaves the previous
complete checkpoint intact. Each checkpoint also holds SHA-256 digests of its files
(`files.sha256.json`, written once Orbax has finalised it) and, in its meta, of its arrays. A
restore checks the files first, so a damaged checkpoint (truncated or corrupted on disk) is
refused before Orbax reads it: a read that fails inside Orbax leaves its other reads running
against an event loop Orbax has closed ("Event loop is closed" at exit). The restored arrays
are then checked against their digests. A checkpoint refused either way is reported by path
and the previous good one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from gpt_jax.config import GPTConfig
from gpt_jax.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer_file


def write_atomic(path: str | os.PathLike, write) -> None:
    """`write(temporary_path)` in `path`'s directory, then rename it to `path`: no half file
    is ever at `path`, and the temporary one is removed if `write` fails. `write` creates the
    file itself, so it gets the mode a plain open() gives (0o666 less the umask), like a run
    directory's other files (a `tempfile.mkstemp` file is 0600, private to its owner)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write `obj` as JSON to `path` (`write_atomic`, flushed to disk before the rename),
    making its directory if needed."""
    def write(tmp):
        with open(tmp, "x") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, write)


def save_config(run_dir, config: GPTConfig) -> None:
    write_json_atomic(Path(run_dir) / "config.json", config.to_dict())


def load_config(run_dir) -> GPTConfig:
    """The run's GPTConfig (one saved before the architecture fields existed is GPT-2's).
    Raises FileNotFoundError naming the run directory when it has no config.json, and
    ValueError naming the file and what is wrong when it is not a GPTConfig's JSON."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory: {path} does not exist "
                                f"(`gpt-jax train --run-dir {run_dir}` trains one; `make "
                                "demo` trains runs/shakespeare-char)")
    try:
        fields = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    try:
        return GPTConfig.from_dict(fields)
    except (ValueError, TypeError) as error:  # TypeError: a value of the wrong type
        raise ValueError(f"{path}: {error}") from None


def save_tokenizer(run_dir, tokenizer) -> None:
    path = Path(run_dir) / "tokenizer.json"
    tmp = path.with_suffix(".json.tmp")
    tokenizer.save(tmp)
    os.replace(tmp, path)


def load_tokenizer(run_dir) -> CharTokenizer | BPETokenizer:
    """The run's tokenizer, whichever kind it is. Raises FileNotFoundError naming the file."""
    path = Path(run_dir) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no tokenizer: {path} does not exist")
    return load_tokenizer_file(path)


class CorruptCheckpointError(ValueError):
    """A checkpoint could not be read back, or its arrays do not match their digest. A
    ValueError: bad input to every command, which answers it in one line."""


def manager(run_dir, keep: int = 3) -> ocp.CheckpointManager:
    """An Orbax manager over `run_dir/checkpoints` keeping the last `keep` checkpoints plus
    the one with the lowest `val_loss` metric."""
    val_loss = lambda metrics: metrics["val_loss"]  # noqa: E731
    # A checkpoint without a val loss (saved before they were written to disk) is kept by
    # LatestN alone: Orbax's BestN would keep every such one forever.
    policy = ocp.checkpoint_managers.AnyPreservationPolicy([
        ocp.checkpoint_managers.LatestN(keep),
        ocp.checkpoint_managers.BestN(get_metric_fn=val_loss, reverse=True, n=1,
                                      keep_checkpoints_without_metrics=False),
    ])
    # best_fn makes Orbax write each checkpoint's metrics beside it (without it they live in
    # memory only, and a resumed run's manager would rank nothing): the ranking survives
    # a resume; which checkpoints are kept is the policy's alone.
    options = ocp.CheckpointManagerOptions(preservation_policy=policy, best_fn=val_loss,
                                           best_mode="min", enable_async_checkpointing=False)
    return ocp.CheckpointManager(
        Path(run_dir).absolute() / "checkpoints", options=options,
        item_names=("params", "opt_state", "meta"),
    )


def _whole(leaf) -> np.ndarray:
    """An array's whole value on this host. One split over several processes' devices is
    gathered: a collective, so every process calls this for the same arrays in order."""
    if isinstance(leaf, jax.Array) and not (leaf.is_fully_addressable
                                            or leaf.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def digest(*trees) -> str:
    """SHA-256 over the bytes, shapes and dtypes of every array in the trees, in tree order
    (the same on every process of a multi-process run)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(trees):
        array = _whole(leaf)
        h.update(f"{array.shape}{array.dtype}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


FILE_DIGESTS = "files.sha256.json"  # in each step directory, beside Orbax's items


def _file_digests(step_dir: Path, items=("params", "opt_state", "meta")) -> dict[str, str]:
    """SHA-256 of every file of the given items, by path relative to `step_dir`."""
    digests = {}
    for item in items:
        for path in sorted((step_dir / item).rglob("*")):
            if path.is_file():
                h = hashlib.sha256()
                with path.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                digests[str(path.relative_to(step_dir))] = h.hexdigest()
    return digests


def _check_files(step_dir: Path, items) -> None:
    """Compare the files of `items` with the digests saved beside them; a checkpoint saved
    without them (by an older version, or killed before they were written) passes.

    Raises:
      CorruptCheckpointError: a file is missing or changed (naming it).
    """
    saved_path = step_dir / FILE_DIGESTS
    if not saved_path.exists():
        _check_readable(step_dir, items)
        return
    try:
        saved = json.loads(saved_path.read_text())
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint {step_dir} is corrupt: {FILE_DIGESTS} "
                                     f"cannot be read ({e})") from e
    found = _file_digests(step_dir, items)
    for name, digest_saved in sorted(saved.items()):
        if name.split("/")[0] in items and found.get(name) != digest_saved:
            what = "is missing" if name not in found else "does not match its saved digest"
            raise CorruptCheckpointError(f"checkpoint {step_dir} is corrupt: its file "
                                         f"{name} {what}")


def _check_readable(step_dir: Path, items) -> None:
    """Read every stored value of the items' OCDBT stores once, one at a time: for a
    checkpoint without file digests, a truncated or missing file fails here, not inside
    Orbax's concurrent reads, which leave the others running when one fails (they then end
    against a closed event loop). Raw bytes only: damage inside a value is left to the
    arrays' digests.

    Raises:
      CorruptCheckpointError: a value cannot be read (naming the item and tensorstore's reason).
    """
    import tensorstore as ts

    for item in items:
        store = step_dir / item
        if not (store / "manifest.ocdbt").exists():  # not an array store (meta is JSON)
            continue
        try:
            kv = ts.KvStore.open({"driver": "ocdbt", "base": store.absolute().as_uri()}).result()
            for key in kv.list().result():
                kv.read(key).result()
        except Exception as e:  # tensorstore raises ValueError and others for damage
            raise CorruptCheckpointError(f"checkpoint {step_dir} cannot be read: its {item} "
                                         f"store: {str(e).splitlines()[0][:200]}") from e


def save(mngr: ocp.CheckpointManager, step: int, params, opt_state, meta: dict,
         val_loss: float | None = None) -> None:
    """Save params, optimizer state and JSON metadata (step, data position, digests) at
    `step`; `val_loss` ranks it for keeping the best."""
    meta = {**meta, "params_digest": digest(params), "opt_state_digest": digest(opt_state)}
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta),
    ), metrics=None if val_loss is None else {"val_loss": float(val_loss)})
    mngr.wait_until_finished()
    if jax.process_index() == 0:  # once every process's files are in place (Orbax's barrier)
        step_dir = Path(mngr.directory) / str(step)
        write_json_atomic(step_dir / FILE_DIGESTS, _file_digests(step_dir))


def _restore_step(mngr, step, params_like, opt_state_like):
    """One checkpoint, its files and then its arrays verified against their digests;
    `opt_state_like=None` skips the optimizer state (returned as None)."""
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
    items = {"params": ocp.args.StandardRestore(abstract(params_like)),
             "meta": ocp.args.JsonRestore()}
    if opt_state_like is not None:
        items["opt_state"] = ocp.args.StandardRestore(abstract(opt_state_like))
    path = mngr.directory / str(step)
    _check_files(Path(path), tuple(items))  # before Orbax reads anything
    try:
        out = mngr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # Orbax/tensorstore raise many types for a damaged file
        reason = str(e).splitlines()[0][:200]  # tensorstore appends its whole spec
        raise CorruptCheckpointError(f"checkpoint {path} cannot be read: {reason}") from e
    opt_state = out.opt_state if opt_state_like is not None else None
    checks = [("params", out.params)] + ([("opt_state", opt_state)] if opt_state else [])
    for name, tree in checks:
        if out.meta.get(f"{name}_digest") != digest(tree):
            raise CorruptCheckpointError(f"checkpoint {path} is corrupt: its {name} do not "
                                         "match the digest saved with them")
    return out.params, opt_state, out.meta


def restore(mngr: ocp.CheckpointManager, step: int | None, params_like, opt_state_like,
            report=print):
    """Restore `(params, opt_state, meta)` into the structure (and shardings) of the given
    trees, from `step` or, when that one is damaged, the newest earlier good checkpoint; each
    damaged checkpoint is reported by path through `report`. `step=None` starts at the
    latest; `opt_state_like=None` restores params only (opt_state comes back None).

    Raises:
      CorruptCheckpointError: no checkpoint at or before `step` can be restored.
    """
    steps = sorted((s for s in mngr.all_steps() if step is None or s <= step), reverse=True)
    errors = []
    for candidate in steps:
        try:
            restored = _restore_step(mngr, candidate, params_like, opt_state_like)
            if errors:
                report(f"restored checkpoint {mngr.directory / str(candidate)} instead")
            return restored
        except CorruptCheckpointError as e:
            errors.append(str(e))
            report(f"{e}; trying the previous checkpoint")
    raise CorruptCheckpointError(f"no usable checkpoint in {mngr.directory}: "
                                 + ("; ".join(errors) or "none saved"))


def load_params(run_dir, step: int | None = None):
    """`(config, params, tokenizer)` of a run, from its latest (or given) good checkpoint,
    with the params on the first device (a run saved from a mesh of several devices too).

    Raises:
      FileNotFoundError: the directory has no config or no checkpoint.
      ValueError: `step` is given and no checkpoint was saved at it (the steps are named).
      CorruptCheckpointError: every candidate checkpoint is damaged.
      RuntimeError: this is one of several `jax.distributed` processes (loading for
        generation is single-process).
    """
    from gpt_jax.params import init_params  # the shapes to restore into

    if jax.process_count() > 1:
        raise RuntimeError(
            f"load_params loads {run_dir} for generation in one process, but this is process "
            f"{jax.process_index()} of {jax.process_count()} (jax.distributed is initialized). "
            "Generation is single-process: `gpt-jax generate`, `gpt-jax serve`, "
            "`LLM.from_checkpoint` and `Engine` run in one process, without --coordinator; a "
            "checkpoint from a multi-process run loads there as it is")
    config = load_config(run_dir)
    with manager(run_dir) as mngr:  # closed on every path: its threads end with it
        steps = sorted(mngr.all_steps())
        if not steps:
            raise FileNotFoundError(f"{run_dir} has no checkpoint under checkpoints/")
        if step is not None and step not in steps:
            raise ValueError(f"{run_dir} has no checkpoint at step {step}; its steps are "
                             f"{steps}")
        # On this process's first device, whatever mesh the run was trained (and saved) on.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params_like = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
            jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0)))
        params, _, _ = restore(mngr, step, params_like, None)
    return config, params, load_tokenizer(run_dir)
