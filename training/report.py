"""What a run reports: metrics JSONL, loss plots, FLOP estimates, and text samples."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpt_jax.config import GPTConfig


def flops_per_token(config: GPTConfig, params, block: int) -> float:
    """Training FLOPs per token, forward + backward: 6 per weight (the position table
    excluded; the tied output projection counted) plus 12 * L * D * T for attention
    scores and values (Kaplan et al. 2020; PaLM appendix B; nanoGPT's `estimate_mfu`)."""
    n = sum(x.size for x in jax.tree.leaves(params))
    n -= params["wpe"].size if "wpe" in params else 0  # rotary positions have no table
    return 6.0 * n + 12.0 * config.n_layers * config.d_model * block


def measure_peak_flops(mesh: Mesh, n: int = 1024, reps: int = 5) -> float:
    """Achieved float32 FLOP/s of n x n matmuls, one per device of `mesh`, run together, the
    fastest of `reps`: the MFU denominator when the device's datasheet peak is not given.
    (Host CPU devices share the cores, so this is the whole host's rate, not one device's
    times the count. The fastest, not the mean: on a machine other jobs load, the mean
    reads far below what the cores reach, and MFU far above; training/README.md.)"""
    a = jax.device_put(jnp.ones((mesh.devices.size, n, n), jnp.float32),
                       NamedSharding(mesh, P(mesh.axis_names[0])))
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    seconds = []
    for _ in range(reps):
        tick = time.perf_counter()
        matmul(a).block_until_ready()
        seconds.append(time.perf_counter() - tick)
    return 2.0 * n**3 * mesh.devices.size / min(seconds)


def append_metrics(run_dir, record: dict) -> None:
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir, step: int) -> None:
    """Keep only metrics at or before `step` (a resumed run logs the later ones again)."""
    rows = [r for r in read_metrics(run_dir) if r["step"] <= step]
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)


def plot_losses(run_dir) -> Path | None:
    """Write run_dir/loss.png: train and val loss against step and against wall time."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, x_key, label in ((axes[0], "step", "step"), (axes[1], "elapsed_s", "wall time (s)")):
        for key in ("train_loss", "val_loss"):
            ax.plot([r[x_key] for r in rows], [r[key] for r in rows], marker=".", label=key)
        ax.set(xlabel=label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="loss (nats/token)", title=Path(run_dir).name)
    axes[0].legend()
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def sample(params, config: GPTConfig, tokenizer, prompt, n_tokens: int, seed: int) -> str:
    """A temperature-0.8 continuation of `prompt` (token ids), as printable text."""
    from inference import SamplingParams, generate

    prompt = [int(t) for t in prompt]
    n_tokens = min(n_tokens, config.max_seq_len - len(prompt))
    sampling = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=n_tokens)
    completion = generate(params, config, [prompt], sampling)[0]
    return "--- sample ---\n" + tokenizer.decode(prompt + completion.tokens) + "\n---"
