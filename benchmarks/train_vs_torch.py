"""Training throughput: our `nanogpt-cpu` preset against the same model in PyTorch.

Usage:
  python benchmarks/train_vs_torch.py                 # 5 rounds of 20 steps each, 2 threads
  python benchmarks/train_vs_torch.py --rounds 3 --steps 10 --out benchmarks/results/x.json
  python benchmarks/train_vs_torch.py --model gpt2 --batch 4 --block 256 --rounds 3 --steps 2
  python benchmarks/train_vs_torch.py --model gpt2 --batch 4 --block 256 --jax-devices 1

Both sides train the same shape (by default nanogpt-cpu: 4 layers, 4 heads, d_model 128,
block 64, batch 12, vocab 65; `--model` names another GPTConfig preset, `--batch` and
`--block` its batch; tied embeddings, GELU-tanh MLP, biases) with AdamW (betas 0.9/0.99,
weight decay 0.1), global-norm clipping at 1.0 and no dropout, on the same random token
batches. PyTorch runs
`transformers.GPT2LMHeadModel` in eager mode with `torch.set_num_threads(threads)`; JAX runs
our jitted, donated train step as `python -m training.train` does: the host split into
`threads` CPU devices (`TrainConfig.cpu_devices`; `--jax-devices` another count), the batch
data-parallel over them. Each side runs in its own worker process (this script with
`--worker`, told over stdin how many steps to run; it answers with the seconds): in one
process the two slowed each other (gpt2 shape: ours 136-146 tokens/s beside torch, 168-178
alone). The two alternate in rounds, so a busy machine slows both alike; the table reports
tokens/s per round and the ratio of the medians. Compilation and warm-up steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def jax_runner(batches, threads, model):
    from gpt_jax.config import GPTConfig
    from training import sharding
    from training.config import TrainConfig
    from training.step import init_state, make_optimizer, make_train_steps
    from training.train import split_host

    batch, block = batches[0][0].shape
    cfg = TrainConfig.preset("nanogpt-cpu", model=model, cpu_devices=threads,
                             batch_size=batch, block_size=block)
    split_host(cfg)  # before JAX's first operation
    config = GPTConfig.preset(model, max_seq_len=block)
    mesh = sharding.make_mesh(cfg.devices)
    optimizer = make_optimizer(cfg)
    state, shardings = init_state(cfg, config, optimizer, mesh)
    held = {"state": state}  # the step donates the old state: keep only the new one
    steps = make_train_steps(config, optimizer, shardings=shardings)  # called one step a call

    def run(n):
        for i in range(n):  # each batch placed on the mesh per step, as the training loop does
            x, y = (sharding.put_batch(a[None, None], mesh, 2) for a in batches[i % len(batches)])
            held["state"], losses = steps(held["state"], x, y, np.int32(1))
        return float(losses[0])  # waits for the last step

    run(3)  # compile and warm up
    return run


def torch_runner(batches, threads, model):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt_jax.config import GPTConfig

    shape = GPTConfig.preset(model)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=shape.vocab_size, n_positions=batches[0][0].shape[1],
                        n_embd=shape.d_model, n_layer=shape.n_layers, n_head=shape.n_heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        activation_function="gelu_new", bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.99))
    tensors = [(torch.from_numpy(x).long(), torch.from_numpy(y).long()) for x, y in batches]
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(n):
        loss = None
        for i in range(n):
            x, y = tensors[i % len(tensors)]
            logits = model(input_ids=x).logits
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        return float(loss)

    run(3)
    return run


RUNNERS = {"jax (ours)": "jax", "pytorch (GPT2LMHeadModel)": "torch"}


def make_batches(args) -> list[tuple[np.ndarray, np.ndarray]]:
    """Eight random `(x, y)` batches of `[batch, block]` token ids (the same in both workers)."""
    from gpt_jax.config import GPTConfig

    vocab = GPTConfig.preset(args.model).vocab_size
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(8):
        data = rng.integers(0, vocab, (args.batch, args.block + 1)).astype(np.int32)
        batches.append((data[:, :-1], data[:, 1:]))
    return batches


def worker(args) -> None:
    """Build one side's runner (compiled, warmed up), say "ready", then for each line `n` on
    stdin run n steps and print their seconds."""
    batches = make_batches(args)
    run = jax_runner(batches, args.jax_devices or args.threads, args.model) \
        if args.worker == "jax" else torch_runner(batches, args.threads, args.model)
    print("ready", flush=True)
    for line in sys.stdin:
        tick = time.perf_counter()
        run(int(line))
        print(time.perf_counter() - tick, flush=True)


def start_worker(side: str, argv: list[str], huge_pages: bool) -> subprocess.Popen:
    """A worker process for `side` ("jax" or "torch"), once it is ready. With `huge_pages`
    (a model `python -m training.train` restarts with them for: `large_buffers`) both sides
    get that malloc setting, so neither pays 4 KiB page faults the other does not."""
    from bench import INSTALL_TORCH  # beside this file (benchmarks/ is on sys.path)
    from training.process import huge_pages_environ

    env = huge_pages_environ() if huge_pages else None
    proc = subprocess.Popen([sys.executable, __file__, *argv, "--worker", side], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        hint = f" (is torch installed? {INSTALL_TORCH})" if side == "torch" else ""
        raise SystemExit(f"the {side} worker failed to start (exit status {proc.wait()}){hint}")
    return proc


def timed_steps(proc: subprocess.Popen, steps: int) -> float:
    """Seconds the worker took for `steps` train steps."""
    proc.stdin.write(f"{steps}\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpt-jax bench train_vs_torch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="train steps per side per round")
    parser.add_argument("--threads", type=int, default=2,
                        help="PyTorch intra-op threads, and our CPU devices")
    parser.add_argument("--jax-devices", type=int, default=0,
                        help="our CPU devices, if not --threads (1: one program, its "
                             "matmuls threaded by XLA)")
    parser.add_argument("--model", default="nanogpt-cpu", help="GPTConfig preset")
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--out", default="",
                        help="default: benchmarks/results/train_vs_torch[-MODEL].json")
    parser.add_argument("--worker", choices=sorted(RUNNERS.values()), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    from gpt_jax.config import GPTConfig

    vocab = GPTConfig.preset(args.model).vocab_size
    tokens = args.steps * args.batch * args.block
    argv = sys.argv[1:] if argv is None else list(argv)
    from training.config import TrainConfig
    from training.train import large_buffers

    huge_pages = large_buffers(TrainConfig.preset("nanogpt-cpu", model=args.model))
    workers = {name: start_worker(side, argv, huge_pages) for name, side in RUNNERS.items()}
    rates = {name: [] for name in workers}
    for r in range(args.rounds):
        for name, proc in workers.items():
            rates[name].append(tokens / timed_steps(proc, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:,.0f} tok/s" for n, v in rates.items()))
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    medians = {name: statistics.median(v) for name, v in rates.items()}
    ours, theirs = medians.values()
    # On a shared machine PyTorch's spinning threads collapse under load while XLA's degrade
    # gently, so the per-round ratios (and the quietest round) matter more than the medians.
    ratios = [a / b for a, b in zip(*rates.values())]
    shape = GPTConfig.preset(args.model)
    result = {"shape": f"{args.model}: L{shape.n_layers} N{shape.n_heads} D{shape.d_model} "
                       f"T{args.block} B{args.batch} V{vocab}", "threads": args.threads, "huge_pages": huge_pages,
              "jax_devices": args.jax_devices or args.threads,
              "steps_per_round": args.steps, "tokens_per_s_by_round": rates,
              "ratio_by_round": ratios, "median_tokens_per_s": medians,
              "median_step_s": {name: args.batch * args.block / v
                                for name, v in medians.items()},
              "speedup": ours / theirs}
    print("ratio by round: " + ", ".join(f"{r:.2f}" for r in ratios))
    print(f"\n{'implementation':<28}{'median tok/s':>14}")
    for name, value in medians.items():
        print(f"{name:<28}{value:>14,.0f}")
    print(f"{'speedup (ours / pytorch)':<28}{ours / theirs:>14.2f}x")
    out = args.out or ("benchmarks/results/train_vs_torch"
                       + ("" if args.model == "nanogpt-cpu" else f"-{args.model}") + ".json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
