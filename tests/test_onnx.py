"""`gpt-jax export --format onnx`: the step with a dense KV cache as an ONNX graph. For a
GPT-2 model and a Llama-style one (grouped-query attention 4:2, rotary with Llama 3's
scaling, RMSNorm, gated SiLU, untied head, and Qwen's q/k/v biases and Qwen3's q/k norm
besides, so one export covers every field of the families): ONNX Runtime's logits equal
`gpt_jax.model.forward`'s within 1e-4 for a left-padded batch of prompts of different
lengths, at the prefill call and 16 decode steps; `inference/onnx_runner.py`, run as a file
in a process where gpt_jax, inference and training cannot be imported, gives
`inference.generate`'s greedy tokens for 32 tokens at batch 1 and 4; the graph passes
`onnx.checker` and holds only standard ONNX operators; bad flags are refused before the
weights are read."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import TEST_XLA_FLAGS, assert_close, assert_lively, lively_params
from gpt_jax import GPTConfig, checkpoint
from gpt_jax import cli as gpt_jax_cli
from gpt_jax.config import RopeScaling
from gpt_jax.model import forward
from inference import SamplingParams, generate, onnx_export
from inference import onnx_runner

RUNNER = Path(__file__).resolve().parents[1] / "inference" / "onnx_runner.py"
MODELS = {
    "gpt2": GPTConfig.preset("tiny"),
    "llama": GPTConfig.preset("tiny-llama", qkv_bias=True, qk_norm=True,
                              rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32)),
}
# `lively_params`' weight scale: at x6 the Llama-style model's float32 logits are already
# 1e-4 from its float64 ones (x3: 5e-6), so a 1e-4 comparison would measure float32 noise
SCALE = {"gpt2": 6.0, "llama": 3.0}
PROMPTS = [[5, 9, 2, 33, 17, 8, 40], [12, 3, 61], [7] * 3 + [21, 2, 50, 19, 4, 44, 30, 1, 6],
           [63]]  # four lengths: 7, 3, 12, 1
TEXT = "KING:"  # the batch-1 runner prompt for the GPT-2 model, through its char tokenizer

# The runner as a file, in a process where the packages cannot be imported.
BLOCKED = r'''
import runpy
import sys


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("gpt_jax", "inference", "training"):
            raise ImportError(f"{name} is blocked: the runner runs without it")
        return None


sys.meta_path.insert(0, Blocked())
runner, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(runner, run_name="__main__")
assert not [m for m in sys.modules if m.partition(".")[0] in ("gpt_jax", "inference")]
'''


def runner_args(name: str, batch: int) -> list[str]:
    if name == "gpt2" and batch == 1:
        return ["--prompt", TEXT]
    return [x for p in PROMPTS[:batch] for x in ("--prompt-ids", ",".join(map(str, p)))]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Both models exported by the CLI from run directories; the runner started on each at
    batch 1 and 4 as soon as its graph is written, `generate`'s tokens computed meanwhile."""
    folder = tmp_path_factory.mktemp("onnx")
    (folder / "blocked.py").write_text(BLOCKED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    cases, runs = {}, {}
    for name, config in MODELS.items():
        params = lively_params(config, scale=SCALE[name])
        run_dir = folder / f"{name}-run"
        checkpoint.save_config(run_dir, config)
        checkpoint.save_tokenizer(run_dir, checkpoint_tokenizer(config))
        checkpoint.save(checkpoint.manager(run_dir), 0, params, params, {"step": 0})
        out = folder / f"{name}.onnx"
        gpt_jax_cli.main(["export", "--format", "onnx", "--run-dir", str(run_dir),
                          "--out", str(out)])
        cases[name] = (config, params, out)
        for batch in (1, 4):
            runs[name, batch] = subprocess.Popen(
                [sys.executable, str(folder / "blocked.py"), str(RUNNER), str(out),
                 "--max-new-tokens", "32", "--threads", "1", *runner_args(name, batch)],
                cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
    expected = {}
    for (name, batch) in runs:
        config, params, _ = cases[name]
        prompts = ([checkpoint_tokenizer(config).encode(TEXT)] if runner_args(name, batch)[0]
                   == "--prompt" else PROMPTS[:batch])
        outputs = generate(params, config, prompts,
                           SamplingParams(temperature=0.0, max_new_tokens=32))
        expected[name, batch] = [o.tokens for o in outputs]
    got = {}
    for key, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        got[key] = json.loads(stdout)
    return {"cases": cases, "expected": expected, "got": got, "folder": folder}


def checkpoint_tokenizer(config):
    """The runs' char tokenizer: a printable character per id."""
    from gpt_jax import CharTokenizer

    return CharTokenizer([chr(ord("!") + i) for i in range(config.vocab_size)])


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_the_models_at_prefill_and_16_decode_steps(exported, name):
    """Each row's prompt then 16 tokens of its own (fed one per call), against `forward`
    over the row's whole sequence: every real position's logits within 1e-4."""
    config, params, out = exported["cases"][name]
    sess, description = session(out), json.loads(Path(f"{out}.json").read_text())
    rng = np.random.default_rng(1)
    rows = [p + rng.integers(0, config.vocab_size, 16).tolist() for p in PROMPTS]
    longest = max(len(r) for r in rows)  # right-padded: causal, so no earlier logit moves
    full = np.array([r + [0] * (longest - len(r)) for r in rows], np.int32)
    want = np.asarray(forward(params, jnp.asarray(full), config))
    ids, mask, positions = onnx_runner.left_pad(PROMPTS)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
             **onnx_runner.empty_past(description, len(PROMPTS))}
    names = [o.name for o in sess.get_outputs()]
    logits, *present = sess.run(names, feeds)
    pad = ids.shape[1]
    for b, prompt in enumerate(PROMPTS):
        assert_close(logits[b, pad - len(prompt):], want[b, :len(prompt)], 1e-4, "prefill")
    for step in range(16):
        new = np.array([[r[len(p) + step]] for r, p in zip(rows, PROMPTS)], np.int32)
        positions = feeds["position_ids"][:, -1:] + 1
        feeds = {"input_ids": new, "position_ids": positions,
                 "attention_mask": np.pad(feeds["attention_mask"], ((0, 0), (0, 1)),
                                          constant_values=1),
                 **{n.replace("present", "past_key_values"): a
                    for n, a in zip(names[1:], present)}}
        logits, *present = sess.run(names, feeds)
        assert logits.shape == (4, 1, config.vocab_size)
        for b, prompt in enumerate(PROMPTS):
            assert_close(logits[b, 0], want[b, len(prompt) + step], 1e-4, f"step {step}")
    K, H = config.kv_heads, config.head_dim
    assert present[0].shape == (4, K, pad + 16, H)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", MODELS)
def test_the_runner_without_the_package_gives_generates_greedy_tokens(exported, name, batch):
    got, expected = exported["got"][name, batch], exported["expected"][name, batch]
    assert got["token_ids"] == expected
    assert all(len(row) == 32 for row in got["token_ids"])
    assert_lively([t for row in expected for t in row], minimum=4)
    tokenizer = checkpoint_tokenizer(exported["cases"][name][0])
    assert got["text"] == [tokenizer.decode(row) for row in expected]
    assert got["prefill_s"] > 0 and got["decode_s"] > 0


def test_the_runner_stops_a_row_at_an_eos_id_and_keeps_it(exported):
    config, _, out = exported["cases"]["gpt2"]
    sess, description = onnx_runner.load(out, threads=1)
    plain = exported["expected"]["gpt2", 4]
    eos = next(t for i, t in enumerate(plain[1]) if i >= 3 and t not in plain[1][:i])
    tokens, _ = onnx_runner.generate(sess, {**description, "eos_token_ids": [eos]}, PROMPTS,
                                     32)
    for row, want in zip(tokens, plain):
        cut = want.index(eos) + 1 if eos in want else 32
        assert row == want[:cut]
    assert len(tokens[1]) < 32


@pytest.mark.parametrize("name", MODELS)
def test_the_graph_passes_the_checker_and_holds_only_standard_onnx_ops(exported, name):
    config, _, out = exported["cases"][name]
    onnx.checker.check_model(str(out), full_check=True)
    model = onnx.load(str(out))
    assert [(o.domain, o.version) for o in model.opset_import] == [("", onnx_export.OPSET)]
    ops = {(node.domain, node.op_type) for node in model.graph.node}
    assert {domain for domain, _ in ops} == {""}  # the default domain: no custom call
    assert ops <= {("", op.name) for op in onnx.defs.get_all_schemas()}
    assert not model.functions
    assert not [op for _, op in ops if "custom" in op.lower() or "jax" in op.lower()]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input}
    assert dims["input_ids"] == ["B", "T"] and dims["attention_mask"] == ["B", "T + P"]
    assert dims["past_key_values.1.value"] == ["B", config.kv_heads, "P", config.head_dim]
    assert [o.name for o in model.graph.output][:3] == ["logits", "present.0.key",
                                                       "present.0.value"]


def test_the_description_beside_the_graph(exported):
    out = exported["cases"]["llama"][2]
    description = json.loads(Path(f"{out}.json").read_text())
    assert description["program"] == out.name and description["opset"] == onnx_export.OPSET
    assert description["external_data"] is None and description["eos_token_ids"] == []
    assert description["tokenizer"]["files"] == [f"{out.name}.tokenizer.json"]
    assert description["model"]["config"]["n_kv_heads"] == 2
    assert [i["name"] for i in description["inputs"]] == [
        "input_ids", "attention_mask", "position_ids", "past_key_values.{l}.key",
        "past_key_values.{l}.value"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_weights_over_the_limit_go_to_external_data(exported, tmp_path):
    """Past `EXTERNAL_OVER` bytes (lowered here to 0) the weights are written to OUT.data,
    which ONNX Runtime reads from beside the graph: the same logits."""
    import onnx_ir

    config, _, out = exported["cases"]["gpt2"]
    moved = tmp_path / "big.onnx"
    assert onnx_export.write_graph(onnx_ir.load(str(out)), moved, external_over=0) == \
        "big.onnx.data"
    assert (tmp_path / "big.onnx.data").stat().st_size > moved.stat().st_size
    description = json.loads(Path(f"{out}.json").read_text())
    feeds = {"input_ids": np.array([[1, 2, 3]], np.int32),
             "attention_mask": np.ones((1, 3), np.int32),
             "position_ids": np.array([[0, 1, 2]], np.int32),
             **onnx_runner.empty_past(description, 1)}
    np.testing.assert_array_equal(session(moved).run(["logits"], feeds)[0],
                                  session(out).run(["logits"], feeds)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]


BAD_FLAGS = [  # (flags, message, argparse's error: exit 2 and the message on stderr)
    (["--format", "tflite"], "argument --format: invalid choice: 'tflite'", True),
    (["--format", "onnx", "--out", "missing/m.onnx"], r"gpt-jax export: --out \S+: the "
     r"folder \S+/missing does not exist; allowed: a path in an existing, writable "
     r"directory$", False),
    (["--out", "missing/m.jaxexport", "--batch", "1", "--prompt-len", "4",
      "--max-new-tokens", "4"], r"gpt-jax export: --out \S+: the folder \S+/missing does "
     r"not exist", False),
    (["--format", "onnx", "--batch", "2"], "--batch: --format jax only", True),
    (["--format", "onnx", "--dtype", "bfloat16"],
     "--dtype bfloat16: --format onnx exports float32; allowed: float32", True),
    ([], "the following arguments are required: --batch, --prompt-len, --max-new-tokens",
     True),
]


@pytest.mark.parametrize("flags, message, by_argparse", BAD_FLAGS)
def test_bad_flags_are_refused_before_the_weights_are_read(tmp_path, config, capsys, flags,
                                                           message, by_argparse):
    checkpoint.save_config(tmp_path, config)  # no checkpoint: reading weights would fail
    args = {"--out": "m.onnx", **dict(zip(flags[::2], flags[1::2]))}
    args["--out"] = str(tmp_path / args["--out"])
    argv = ["export", "--run-dir", str(tmp_path)] + [x for kv in args.items() for x in kv]
    with pytest.raises(SystemExit) as stop:
        gpt_jax_cli.main(argv)
    if by_argparse:
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
    else:  # a one-line refusal
        assert re.match(message, str(stop.value.code)), stop.value.code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.parametrize("flags, message", [
    (["--prompt-ids", "3,64"], r"prompt \[3, 64\]: allowed: one or more ids in \[0, 64\)"),
    (["--prompt-ids", "3", "--max-new-tokens", "128"],
     "a prompt of 1 tokens \\+ --max-new-tokens 128 exceeds the model's context of 128"),
    (["--prompt-ids", "3", "--max-new-tokens", "0"], "--max-new-tokens 0; allowed: an int >= 1"),
])
def test_the_runner_refuses_a_bad_request_in_one_line(exported, flags, message):
    out = exported["cases"]["gpt2"][2]
    with pytest.raises(SystemExit, match=f"^onnx_runner.py: {message}$"):
        onnx_runner.main([str(out), *flags])
