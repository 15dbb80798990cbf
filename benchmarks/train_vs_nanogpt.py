"""Training speed and loss against nanoGPT itself: its `train.py` and ours, same run, in turn.

Usage:
  python benchmarks/train_vs_nanogpt.py                    # 2000 iterations, 2 rounds
  python benchmarks/train_vs_nanogpt.py --iters 300 --rounds 1    # a quick look
  python benchmarks/train_vs_nanogpt.py --preset shakespeare-char  # the demo's run
  gpt-jax bench train_vs_nanogpt --iters 300 --rounds 1

nanoGPT (`../shared/baselines/nanogpt`, karpathy/nanoGPT, MIT) runs from a temporary copy as
a subprocess, as its README runs it on a CPU: `config/train_shakespeare_char.py` with
`--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
--batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0`, `OMP_NUM_THREADS` set
to `--threads`, its data written by its `prepare_local.py` from the same text file. Ours is
`python -m training.train` with the same model, batch, schedule (learning rate and its
floor, warmup, betas, weight decay, clipping), iterations and evaluation interval, on the
host split as its command line splits it. Nothing of nanoGPT is imported here.

The two alternate (nanoGPT first in odd rounds, ours first in even ones), so a busy machine
slows both alike. Per side and round: the median iteration time (nanoGPT's own `time ...ms`
per iteration; ours from `step_seconds` in the run's metrics.jsonl; the first iteration
compiles in ours and is left out of both), tokens/s from it, the whole subprocess's wall
time, and the val curve (nanoGPT: 20 random val batches per evaluation; ours:
`eval_batches` fixed ones). Prints a table and writes results/train_vs_nanogpt[-TAG].json
and .png (after every round). Exits with status 1 when the baseline folder is missing, 2
when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT.parent / "shared" / "baselines" / "nanogpt"
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
_ITER = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def settings(preset: str, iters: int | None):
    """The TrainConfig of `preset` (nanoGPT's learning rate for nanogpt-cpu, as the issue
    compares them) with `iters` steps, and the flags that give nanoGPT the same run."""
    from gpt_jax.config import GPTConfig
    from training.config import TrainConfig

    overrides = {"learning_rate": 1e-3, "min_learning_rate": 1e-4} \
        if preset == "nanogpt-cpu" else {}
    cfg = TrainConfig.preset(preset, **overrides)
    if iters:  # evaluations at the same steps, the last one included (nanoGPT evaluates
        # at multiples of its interval only): the largest divisor within the preset's
        every = max(d for d in range(1, min(cfg.eval_interval, iters) + 1) if iters % d == 0)
        cfg = TrainConfig.preset(preset, **overrides, max_steps=iters, eval_interval=every)
    model = GPTConfig.preset(cfg.model)
    block = cfg.block_size or model.max_seq_len
    nano = {"device": "cpu", "compile": False, "eval_iters": cfg.eval_batches,
            "log_interval": 1, "block_size": block, "batch_size": cfg.batch_size,
            "gradient_accumulation_steps": cfg.grad_accum, "n_layer": model.n_layers,
            "n_head": model.n_heads, "n_embd": model.d_model, "dropout": 0.0,
            "max_iters": cfg.max_steps, "lr_decay_iters": cfg.max_steps,
            "learning_rate": cfg.learning_rate, "min_lr": cfg.min_learning_rate,
            "warmup_iters": cfg.warmup_steps, "beta1": cfg.beta1, "beta2": cfg.beta2,
            "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip,
            "eval_interval": cfg.eval_interval}
    return cfg, nano


def nanogpt_flags(nano: dict) -> list[str]:
    """configurator.py's `--key=value` flags (it `literal_eval`s each value)."""
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in nano.items()]


def run_nanogpt(workdir: Path, nano: dict, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py",
           *nanogpt_flags(nano)]
    tick = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - tick
    if done.returncode:
        raise RuntimeError(f"nanoGPT failed ({done.returncode}):\n{done.stderr[-3000:]}")
    times, vals = {}, []
    for line in done.stdout.splitlines():
        if m := _ITER.match(line):
            times[int(m.group(1))] = float(m.group(3)) / 1e3
        elif m := _EVAL.match(line):
            vals.append((int(m.group(1)), float(m.group(3))))
    # Iteration i (from 0) is optimizer step i + 1; it runs one more than max_iters (after
    # the last evaluation): leave that one out, and the first, as in ours.
    steps = [times[i] for i in range(1, nano["max_iters"])]
    return {"iter_seconds": steps, "val": vals, "wall_s": wall}


def run_ours(run_dir: Path, preset: str, cfg, corpus: Path) -> dict:
    cmd = [sys.executable, "-m", "training.train", "--preset", preset,
           "--text", str(corpus), "--run-dir", str(run_dir),
           "--learning-rate", str(cfg.learning_rate),
           "--min-learning-rate", str(cfg.min_learning_rate),
           "--max-steps", str(cfg.max_steps), "--eval-interval", str(cfg.eval_interval),
           "--sample-tokens", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    tick = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - tick
    if done.returncode:
        raise RuntimeError(f"training.train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for r in rows for s in r["step_seconds"]][1:]  # the first step compiles
    vals = [(r["step"], r["val_loss"]) for r in rows]
    return {"iter_seconds": steps, "val": vals, "wall_s": wall}


def summary(runs: list[dict], tokens_per_iter: int) -> dict:
    medians = [statistics.median(r["iter_seconds"]) for r in runs]
    return {"median_iter_ms_by_round": [1e3 * m for m in medians],
            "tokens_per_s_by_round": [tokens_per_iter / m for m in medians],
            "tokens_per_s": tokens_per_iter / statistics.median(medians),
            "wall_s_by_round": [r["wall_s"] for r in runs],
            "train_s_by_round": [sum(r["iter_seconds"]) for r in runs],
            "val_by_round": [r["val"] for r in runs],
            "final_val_by_round": [r["val"][-1][1] for r in runs]}


def write_results(args, cfg, nano: dict, runs: dict) -> dict:
    """The rounds both sides have finished, as results/train_vs_nanogpt[-TAG].json and .png
    (rewritten after every round, so an interrupted run keeps what it measured)."""
    tokens_per_iter = cfg.grad_accum * cfg.batch_size * nano["block_size"]
    done = min(len(r) for r in runs.values())
    result = {"machine": machine(), "args": vars(args), "preset": args.preset,
              "iterations": cfg.max_steps, "tokens_per_iter": tokens_per_iter,
              "rounds_done": done, "nanogpt_flags": nano,
              **{name: summary(r[:done], tokens_per_iter) for name, r in runs.items()}}
    result["ratio"] = result["ours"]["tokens_per_s"] / result["nanogpt"]["tokens_per_s"]
    result["ratio_by_round"] = [a / b for a, b in zip(
        result["ours"]["tokens_per_s_by_round"], result["nanogpt"]["tokens_per_s_by_round"])]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"train_vs_nanogpt{'-' + args.tag if args.tag else ''}"
    path.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    return {**result, "path": str(path)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, colour in (("nanogpt", "tab:orange"), ("ours", "tab:blue")):
        side = result[name]
        for r, curve in enumerate(side["val_by_round"]):
            steps, vals = zip(*curve)
            ax.plot(steps, vals, color=colour, alpha=0.5 + 0.5 / (r + 1),
                    label=f"{name} round {r + 1}")
        bx.plot(range(1, len(side["tokens_per_s_by_round"]) + 1),
                side["tokens_per_s_by_round"], "o-", color=colour, label=name)
    ax.set(xlabel="iteration", ylabel="val loss (nats/char)", title="val loss")
    bx.set(xlabel="round", ylabel="tokens/s (median iteration)",
           title=f"ours / nanoGPT = {result['ratio']:.2f}x")
    ax.legend(), bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpt-jax bench train_vs_nanogpt",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="nanogpt-cpu",
                        choices=("nanogpt-cpu", "shakespeare-char"),
                        help="our TrainConfig preset; shakespeare-char: the demo's run, "
                             "on the built-in plays")
    parser.add_argument("--iters", type=int, default=0, help="iterations; 0 = the preset's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="nanoGPT's OMP_NUM_THREADS")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    if not (BASELINE / "train.py").exists():
        print(f"train_vs_nanogpt: no nanoGPT baseline at {BASELINE} (its train.py is "
              "missing); nothing to compare against", file=sys.stderr)
        return 1
    cfg, nano = settings(args.preset, args.iters)
    runs = {"nanogpt": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="train_vs_nanogpt-") as tmp:
        tmp = Path(tmp)
        workdir = tmp / "nanogpt"
        # The baseline is read-only: copied writable, so its run can write and the copy
        # can be removed.
        shutil.copytree(BASELINE, workdir, copy_function=shutil.copyfile)
        for folder in (workdir, *(p for p in workdir.rglob("*") if p.is_dir())):
            folder.chmod(0o755)
        corpus = CORPUS
        if args.preset == "shakespeare-char":  # the built-in plays, as one file for both
            from training.data import shakespeare_text

            corpus = tmp / "plays.txt"
            corpus.write_text(shakespeare_text(), encoding="utf-8")
        subprocess.run([sys.executable, "prepare_local.py", str(corpus),
                        "data/shakespeare_char"], cwd=workdir, check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                order = ("nanogpt", "ours") if r % 2 == 0 else ("ours", "nanogpt")
                for name in order:
                    if name == "nanogpt":
                        shutil.rmtree(workdir / "out-shakespeare-char", ignore_errors=True)
                        runs[name].append(run_nanogpt(workdir, nano, args.threads))
                    else:
                        runs[name].append(run_ours(tmp / f"ours-{r}", args.preset, cfg, corpus))
                    last = runs[name][-1]
                    print(f"round {r + 1} {name:8}: median "
                          f"{1e3 * statistics.median(last['iter_seconds']):.1f} ms/iter, "
                          f"wall {last['wall_s']:.0f} s, val {last['val'][-1][1]:.4f}",
                          flush=True)
                write_results(args, cfg, nano, runs)  # after each round
        except RuntimeError as error:
            print(f"train_vs_nanogpt: {error}", file=sys.stderr)
            return 2
    result = write_results(args, cfg, nano, runs)
    print(f"\n{args.preset}, {cfg.max_steps} iterations of {result['tokens_per_iter']} "
          f"tokens, {args.rounds} round(s); load average now {os.getloadavg()[0]:.1f}")
    print(f"{'run':<10}{'tokens/s':>10}{'ms/iter':>10}{'wall s':>10}{'train s':>10}"
          f"{'val':>9}")
    for name in ("nanogpt", "ours"):
        s = result[name]
        print(f"{name:<10}{s['tokens_per_s']:>10,.0f}"
              f"{statistics.median(s['median_iter_ms_by_round']):>10.1f}"
              f"{statistics.median(s['wall_s_by_round']):>10.0f}"
              f"{statistics.median(s['train_s_by_round']):>10.0f}"
              f"{statistics.median(s['final_val_by_round']):>9.4f}")
    print(f"ours / nanoGPT: {result['ratio']:.2f}x (by round: "
          + ", ".join(f"{r:.2f}" for r in result["ratio_by_round"]) + ")")
    print(f"wrote {result['path']}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
