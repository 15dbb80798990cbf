r"""Generate with a `gpt-jax export --format onnx` graph in ONNX Runtime: the reference host
loop, with only numpy, onnxruntime and (for text) tokenizers; it imports nothing of gpt-jax.

Usage:
  python inference/onnx_runner.py MODEL.onnx --prompt-ids 1,2,3 --max-new-tokens 32
  python inference/onnx_runner.py MODEL.onnx --prompt "Hello" --prompt "The" \
      --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 1 --threads 2

Reads MODEL.onnx.json (written beside the graph: the signature, max_seq_len, EOS ids, the
tokenizer copy). Prints one JSON object: `token_ids` (a list per prompt: the new tokens, an
EOS that ended the row kept), `text` (their decoded text per prompt, null without a
tokenizer), `prefill_s` and `decode_s` (wall seconds of the prefill call and of the decode
calls).

The loop: the prompts left-padded into one batch (attention_mask 0 on the padding,
position_ids each token's count of real tokens before it), a prefill call with a past of
length 0, then one call per token, each call's `present.*` fed back as `past_key_values.*`
and attention_mask grown by a 1. Temperature 0 is greedy (argmax, the first of ties); else
the logits are divided by the temperature and, with top_p < 1, sampling keeps the smallest
set of tokens whose probability reaches top_p (numpy's generator, seeded: the same seed
repeats exactly, but the draws differ from gpt-jax's own). A row stops after an EOS id of the
JSON or after --max-new-tokens tokens. Errors (a prompt past the model's context, an id
outside the vocabulary, text without a tokenizer) exit with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def load(model: str | Path, threads: int = 0):
    """`(session, description)`: the graph in an ONNX Runtime CPU session (`threads` intra-op
    threads, 0 = its default) and MODEL.json beside it."""
    description = json.loads(Path(f"{model}.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return session, description


def left_pad(prompts: list[list[int]]):
    """`(input_ids, attention_mask, position_ids)` int32 `[B, T]` of the prompts padded on
    the left to the longest (id 0, mask 0, position 0 on the padding)."""
    T = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros((len(prompts), T), np.int32)
    for b, prompt in enumerate(prompts):
        ids[b, T - len(prompt):] = prompt
        mask[b, T - len(prompt):] = 1
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)


def empty_past(description: dict, batch: int) -> dict[str, np.ndarray]:
    """Every `past_key_values.*` input at length 0: `[B, K, 0, H]` float32."""
    past = {}
    for spec in description["inputs"]:
        if spec["per_layer"]:
            _, K, _, H = spec["shape"]
            for layer in range(description["n_layers"]):
                past[spec["name"].format(l=layer)] = np.zeros((batch, K, 0, H), np.float32)
    return past


def next_tokens(logits_BV: np.ndarray, temperature: float, top_p: float,
                rng: np.random.Generator) -> np.ndarray:
    """One token per row: argmax for temperature 0, else a draw from the softmax of
    logits / temperature restricted to its top-p nucleus. int32 `[B]`."""
    if temperature == 0:
        return logits_BV.argmax(-1).astype(np.int32)
    z = logits_BV.astype(np.float64) / temperature
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, -1)
    # keep a token while the mass before it is short of top_p (the first is always kept)
    keep = (np.cumsum(sorted_probs, -1) - sorted_probs) < top_p
    sorted_probs = np.where(keep, sorted_probs, 0.0)
    sorted_probs /= sorted_probs.sum(-1, keepdims=True)
    picks = [rng.choice(len(row), p=row) for row in sorted_probs]
    return np.take_along_axis(order, np.array(picks)[:, None], -1)[:, 0].astype(np.int32)


def check(description: dict, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Raise ValueError for an empty prompt, an id outside the vocabulary, a max_new_tokens
    under 1, or a prompt that would run past the model's context."""
    V, context = description["model"]["config"]["vocab_size"], description["max_seq_len"]
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}; allowed: an int >= 1")
    for prompt in prompts:
        if not prompt or not all(0 <= t < V for t in prompt):
            raise ValueError(f"prompt {prompt}: allowed: one or more ids in [0, {V})")
        if len(prompt) + max_new_tokens > context:
            raise ValueError(f"a prompt of {len(prompt)} tokens + --max-new-tokens "
                             f"{max_new_tokens} exceeds the model's context of {context}")


def generate(session, description: dict, prompts: list[list[int]], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
    """Run the loop (see the module docstring). Returns `(token_ids, timings)`: a list of new
    ids per prompt, and `{"prefill_s", "decode_s"}`. Raises ValueError as `check` does."""
    check(description, prompts, max_new_tokens)
    rng = np.random.default_rng(seed)
    eos = set(description["eos_token_ids"])
    ids, mask, positions = left_pad(prompts)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
             **empty_past(description, len(prompts))}
    out_names = [o.name for o in session.get_outputs()]
    past_names = [n.replace("present", "past_key_values") for n in out_names[1:]]
    tokens = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    tick = time.perf_counter()
    timings = {}
    for step in range(max_new_tokens):
        logits, *present = session.run(out_names, feeds)
        if step == 0:
            timings["prefill_s"], tick = time.perf_counter() - tick, time.perf_counter()
        new = next_tokens(logits[:, -1], temperature, top_p, rng)
        for b in np.flatnonzero(~done):
            tokens[b].append(int(new[b]))
            done[b] = new[b] in eos or len(tokens[b]) == max_new_tokens
        if done.all():
            break
        positions = feeds["position_ids"][:, -1:] + 1
        mask = np.concatenate([feeds["attention_mask"], np.ones_like(positions)], axis=1)
        feeds = {"input_ids": new[:, None], "attention_mask": mask, "position_ids": positions,
                 **dict(zip(past_names, present))}
    timings["decode_s"] = time.perf_counter() - tick
    return tokens, timings


def load_tokenizer(model: str | Path, description: dict):
    """`(encode, decode)` of the tokenizer copy beside the graph, or None without one."""
    note = description.get("tokenizer")
    if not note:
        return None
    files = [Path(model).with_name(name) for name in note["files"]]
    if note["kind"] == "char":  # gpt-jax's char tokenizer: id i is chars[i]
        chars = json.loads(files[0].read_text())["chars"]
        index = {c: i for i, c in enumerate(chars)}
        return (lambda text: [index[c] for c in text]), (lambda ids: "".join(chars[i] for i in ids))
    import tokenizers

    if len(files) == 1:
        tokenizer = tokenizers.Tokenizer.from_file(str(files[0]))
    else:  # vocab.json + merges.txt: byte-level BPE, as GPT-2's directory has it
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*map(str, files)))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
            lambda ids: tokenizer.decode(ids))


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, "
                                         f"got {text!r}") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="onnx_runner.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the .onnx file (its .json beside it)")
    p.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    p.add_argument("--prompt-ids", type=_ids, action="append", default=[], metavar="IDS",
                   help="token-id prompt, comma-separated (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads, 0 = ORT's default")
    args = p.parse_args(argv)
    if bool(args.prompt) == bool(args.prompt_ids):
        p.error("give --prompt or --prompt-ids (either repeatable), not both or neither")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error(f"--temperature {args.temperature} --top-p {args.top_p}; allowed: a "
                "temperature >= 0 and a top-p in (0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        session, description = load(args.model, args.threads)
        tokenizer = load_tokenizer(args.model, description)
        if args.prompt and tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer beside it; pass --prompt-ids")
        prompts = args.prompt_ids or [tokenizer[0](text) for text in args.prompt]
        tokens, timings = generate(session, description, prompts, args.max_new_tokens,
                                   args.temperature, args.top_p, args.seed)
    except (ValueError, OSError) as error:
        raise SystemExit(f"onnx_runner.py: {error}") from None
    text = [tokenizer[1](row) for row in tokens] if tokenizer else None
    print(json.dumps({"token_ids": tokens, "text": text, **timings}))


if __name__ == "__main__":
    main(sys.argv[1:])
