"""`gpt-jax export`: the generation program as one `jax.export` file. A process in which
importing gpt_jax, inference and training fails loads it with `jax.export.deserialize`
and calls it: its tokens equal `inference.generate`'s for the same requests (greedy and
seeded top-p), for the shakespeare-char shape (exported by the CLI from a run directory,
for cpu and cuda), a GPT-2-shaped model (GPT-2's vocabulary and context, two narrow
layers; exported through the API, with an EOS id) and a tiny Llama-style model (exported by
the CLI from a Hugging Face directory whose config.json names an EOS id). A call with another batch or prompt
length fails with jax's shape error. Bad CLI input fails before the weights are read."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import TEST_XLA_FLAGS
from gpt_jax import CharTokenizer, GPTConfig, checkpoint, init_params, save_hf
from gpt_jax.kernels import paged_attention
from gpt_jax import cli as gpt_jax_cli
from inference import SamplingParams, export, generate

CHAR = GPTConfig.preset("shakespeare-char")
GPT2_SHAPED = GPTConfig.preset("gpt2", n_layers=2, n_heads=2, d_model=64)
CHAR_SHAPE = dict(batch=4, prompt_len=16, max_new_tokens=24)
GPT2_SHAPE = dict(batch=2, prompt_len=32, max_new_tokens=16)
LLAMA = GPTConfig.preset("tiny-llama")  # RMSNorm, rotary, gated SiLU, GQA 4:2, untied
LLAMA_SHAPE = dict(batch=2, prompt_len=16, max_new_tokens=16)

# Runs in the subprocess: block the package before anything imports, then, for each job
# line on stdin, load and call its program on its saved inputs, and once more with a batch
# and a prompt length too many.
LOADER = r'''
import sys


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("gpt_jax", "inference", "training"):
            raise ImportError(f"{name} is blocked: an exported program runs without it")
        return None


sys.meta_path.insert(0, Blocked())
import argparse
import json

import jax
import numpy as np

report = {}
for line in sys.stdin:  # one job per line, as the test exports them
    job = json.loads(line)
    exported = jax.export.deserialize(bytearray(open(job["program"], "rb").read()))
    inputs = np.load(job["inputs"])
    args = [inputs[name] for name in job["names"]]
    output_tokens, num_tokens_B = exported.call(*args)
    # every row's first token set to each of job["first_ids"] (out-of-range ones included)
    firsts = {}
    for first in job["first_ids"]:
        tokens_BT = args[0].copy()
        tokens_BT[:, 0] = first
        firsts[f"first_{first}"] = np.asarray(exported.call(tokens_BT, *args[1:])[0])
    np.savez(job["outputs"], output_tokens=output_tokens, num_tokens_B=num_tokens_B, **firsts)
    errors = {}
    for what, grow in (("batch", lambda a: np.concatenate([a, a[:1]])),
                       ("prompt_len", lambda a: np.pad(a, ((0, 0), (0, 1))))):
        bad = [grow(args[0])] + [grow(a) if what == "batch" else a for a in args[1:]]
        try:
            exported.call(*bad)
            errors[what] = None
        except ValueError as error:
            errors[what] = str(error)
    report[job["program"]] = {"platforms": list(exported.platforms), "errors": errors}
for name in ("gpt_jax", "inference", "training"):
    try:
        __import__(name)
        report[name] = "imported"
    except ImportError as error:
        report[name] = str(error)
report["loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] in
                          ("gpt_jax", "inference", "training"))
print(json.dumps(report))
'''


def requests(config, shape, seed=0):
    """Prompts of several lengths up to prompt_len, half greedy, half seeded top-p."""
    rng = np.random.default_rng(seed)
    B, T = shape["batch"], shape["prompt_len"]
    lengths = [T, 5, 1, T - 3][:B]
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    sampling = [(0.0, 1.0), (0.8, 0.9), (1.0, 0.95), (0.0, 1.0)][:B]
    return prompts, [dict(temperature=t, top_p=p, seed=100 + b)
                     for b, (t, p) in enumerate(sampling)]


def call_inputs(prompts, rows, T):
    """The exported call's arguments for these requests (padding: 7, not the model's 0)."""
    tokens_BT = np.full((len(prompts), T), 7, np.int32)
    for b, prompt in enumerate(prompts):
        tokens_BT[b, :len(prompt)] = prompt
    return {"tokens_BT": tokens_BT, "lengths_B": np.array([len(p) for p in prompts], np.int32),
            "temperature_B": np.array([r["temperature"] for r in rows], np.float32),
            "top_p_B": np.array([r["top_p"] for r in rows], np.float32),
            "seed_B": np.array([r["seed"] for r in rows], np.uint32)}


def reference(params, config, prompts, rows, max_new_tokens, eos=None):
    """`inference.generate`'s tokens for the same requests (the CPU kernel's attention)."""
    sampling = [SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=() if eos is None else (eos,),
                               **r) for r in rows]
    return [o.tokens for o in generate(params, config, prompts, sampling)]


def save_run(run_dir: Path, config, params, tokenizer=None) -> None:
    """A run directory as training leaves it: config, tokenizer, one checkpoint."""
    checkpoint.save_config(run_dir, config)
    checkpoint.save_tokenizer(run_dir, tokenizer or CharTokenizer(
        [chr(ord("!") + i) for i in range(config.vocab_size)]))
    checkpoint.save(checkpoint.manager(run_dir), 0, params, params, {"step": 0})


def quick_params(config, seed=0):
    """Random params made with numpy (jax.random compiles its ops anew for every shape):
    `lively_params`' scale, N(0, 0.12) matrices, unit LayerNorm scales, zero biases."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = path[-1].key
        if name == "scale":
            return np.ones(shape.shape, np.float32)
        if name == "bias" or name.startswith("b_"):
            return np.zeros(shape.shape, np.float32)
        return rng.normal(0.0, 0.12, shape.shape).astype(np.float32)

    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return jax.tree_util.tree_map_with_path(leaf, shapes)


def job(folder: Path, name: str, config, shape, out: Path) -> str:
    """The loader's job line for one program: its file, inputs and where outputs go."""
    prompts, rows = requests(config, shape)
    np.savez(folder / f"{name}-in.npz", **call_inputs(prompts, rows, shape["prompt_len"]))
    return json.dumps({"program": str(out), "inputs": str(folder / f"{name}-in.npz"),
                       "outputs": str(folder / f"{name}-out.npz"),
                       "names": [name for name, *_ in export.INPUTS],
                       "first_ids": first_ids(config)}) + "\n"


def first_ids(config):
    """First prompt tokens the loader tries: two outside the vocabulary on each side, and
    the ids the program clamps them to."""
    V = config.vocab_size
    return [-5, 0, V - 1, V + 5]


def feed(process: subprocess.Popen, line: str) -> None:
    """Write one line to a process's stdin; a process that died shows its own error, not
    the BrokenPipeError of the write."""
    try:
        process.stdin.write(line)
        process.stdin.flush()
    except BrokenPipeError:
        process.stdin = None  # closed: communicate() must not flush it again
        _, stderr = process.communicate(timeout=60)
        raise AssertionError(f"the loader exited ({process.returncode}) before reading "
                             f"its job:\n{stderr[-3000:]}") from None


def export_llama(folder: Path):
    """The tiny Llama-style model as a Hugging Face directory (`save_hf`) whose config.json
    names as EOS a token its greedy row first emits mid-way, exported by `gpt-jax export
    --hf-checkpoint`: the case tuple of `exported`."""
    params = quick_params(LLAMA, seed=2)  # its greedy row meets a new token mid-way
    hf_dir = folder / "llama-hf"
    save_hf(LLAMA, params, hf_dir)
    prompts, rows = requests(LLAMA, LLAMA_SHAPE)
    plain = reference(params, LLAMA, prompts, rows, LLAMA_SHAPE["max_new_tokens"])
    eos = next(t for i, t in enumerate(plain[0]) if i >= 3 and t not in plain[0][:i])
    hf = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(hf | {"eos_token_id": eos}))
    out = folder / "llama.jaxexport"
    gpt_jax_cli.main(["export", "--hf-checkpoint", str(hf_dir), "--out", str(out),
                      "--batch", "2", "--prompt-len", "16", "--max-new-tokens", "16"])
    return params, LLAMA, LLAMA_SHAPE, eos, out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Export both models and hand each to the loader as soon as it is written; compute
    `generate`'s tokens while the loader compiles. Returns what the tests look at."""
    assert paged_attention.available(), "the kernel must be there for the export to avoid it"
    folder = tmp_path_factory.mktemp("export")
    (folder / "loader.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # the suite's (conftest): compiles sooner, same tokens
    if jax.config.jax_compilation_cache_dir:  # conftest's cache: warm reruns compile nothing
        env.update(JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    loader = subprocess.Popen([sys.executable, str(folder / "loader.py")], cwd=folder, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        cases = {}

        char_params = quick_params(CHAR)
        save_run(folder / "char-run", CHAR, char_params)
        char_out = folder / "char.jaxexport"
        gpt_jax_cli.main(["export", "--run-dir", str(folder / "char-run"), "--out",
                          str(char_out), "--batch", "4", "--prompt-len", "16",
                          "--max-new-tokens", "24", "--platforms", "cpu,cuda"])
        cases["char"] = (char_params, CHAR, CHAR_SHAPE, None, char_out)
        feed(loader, job(folder, "char", CHAR, CHAR_SHAPE, char_out))

        gpt2_params = quick_params(GPT2_SHAPED)
        prompts, rows = requests(GPT2_SHAPED, GPT2_SHAPE)
        plain = reference(gpt2_params, GPT2_SHAPED, prompts, rows,
                          GPT2_SHAPE["max_new_tokens"])
        # EOS: a token the greedy row first emits mid-way, so the stop is exercised
        eos = next(t for i, t in enumerate(plain[0]) if i >= 3 and t not in plain[0][:i])
        program = export.export_generate(gpt2_params, GPT2_SHAPED, eos_token_id=eos,
                                         **GPT2_SHAPE)
        gpt2_out = folder / "gpt2.jaxexport"
        export.write_export(program, gpt2_out, GPT2_SHAPED, eos_token_id=eos, source="test",
                            dtype="float32", tokenizer={})
        cases["gpt2"] = (gpt2_params, GPT2_SHAPED, GPT2_SHAPE, eos, gpt2_out)
        feed(loader, job(folder, "gpt2", GPT2_SHAPED, GPT2_SHAPE, gpt2_out))

        cases["llama"] = export_llama(folder)
        feed(loader, job(folder, "llama", LLAMA, LLAMA_SHAPE, cases["llama"][-1]))

        expected = {}
        for name, (params, config, shape, eos, _) in cases.items():  # while the loader runs
            prompts, rows = requests(config, shape)
            expected[name] = reference(params, config, prompts, rows, shape["max_new_tokens"],
                                       eos)
        stdout, stderr = loader.communicate(timeout=300)
        assert loader.returncode == 0, stderr[-3000:]
    finally:
        if loader.poll() is None:  # a failure above: stop the loader
            loader.kill()
            loader.communicate()
    report = json.loads(stdout.strip().splitlines()[-1])
    got = {}
    for name in cases:
        result = np.load(folder / f"{name}-out.npz")
        got[name] = [row[:n].tolist() for row, n in zip(result["output_tokens"],
                                                         result["num_tokens_B"])]
        got[f"{name} firsts"] = {k: result[k].tolist() for k in result.files
                                 if k.startswith("first_")}
    return {"folder": folder, "report": report, "expected": expected, "got": got,
            "cases": cases, "gpt2_program": program}


def test_a_process_without_the_package_runs_the_program(exported):
    report = exported["report"]
    for name in ("gpt_jax", "inference", "training"):
        assert "is blocked" in report[name]  # really not importable there
    assert report["loaded"] == []
    assert report[str(exported["cases"]["char"][-1])]["platforms"] == ["cpu", "cuda"]


@pytest.mark.parametrize("name", ["char", "gpt2", "llama"])
def test_exported_tokens_equal_generate(exported, name):
    got, expected = exported["got"][name], exported["expected"][name]
    *_, shape, eos, _ = exported["cases"][name]
    assert got == expected
    assert len({t for row in got for t in row}) >= 8, got  # lively enough to tell apart
    if eos is None:
        assert all(len(row) == shape["max_new_tokens"] for row in got)
    else:  # the greedy row stopped at the EOS id, which it kept
        assert got[0][-1] == eos and len(got[0]) < shape["max_new_tokens"]


@pytest.mark.parametrize("name", ["char", "gpt2", "llama"])
def test_token_ids_outside_the_vocabulary_are_clamped_on_both_sides(exported, name):
    """Fault (issue 41): the program read id -5 as id V-5 (jax's gather wraps negative
    indices like numpy); the README says out-of-range ids are clamped: -5 runs as 0 and
    V+5 as V-1, the prompt's hash (a sampled row's noise) included."""
    V = exported["cases"][name][1].vocab_size
    firsts = exported["got"][f"{name} firsts"]
    assert firsts["first_-5"] == firsts["first_0"]
    assert firsts[f"first_{V + 5}"] == firsts[f"first_{V - 1}"]
    assert firsts["first_0"] != firsts[f"first_{V - 1}"]  # the first token matters


def test_a_loader_that_dies_shows_its_own_error():
    """The fixture's loader failing before it read its job surfaced as a BrokenPipeError of
    the write (issue 41); `feed` shows the loader's stderr instead."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('loader broke')"],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.wait()
    with pytest.raises(AssertionError, match="exited \\(1\\) before reading its job:\nloader broke"):
        feed(process, "x" * 100_000 + "\n")


def test_another_batch_or_prompt_length_fails_with_jax_shape_error(exported):
    for name in ("char", "gpt2"):
        *_, shape, _, out = exported["cases"][name]
        B, T = shape["batch"], shape["prompt_len"]
        errors = exported["report"][str(out)]["errors"]
        assert errors["batch"] == (f"Shape mismatch for args[0].shape[0] (expected same "
                                   f"constant): expected ({B}, {T}) and called with "
                                   f"({B + 1}, {T})")
        assert errors["prompt_len"] == (f"Shape mismatch for args[0].shape[1] (expected same "
                                        f"constant): expected ({B}, {T}) and called with "
                                        f"({B}, {T + 1})")


def test_the_cli_writes_the_program_its_description_and_the_tokenizer(exported):
    out = exported["cases"]["char"][-1]
    run_dir = exported["folder"] / "char-run"
    description = json.loads(Path(f"{out}.json").read_text())
    assert description["program"] == out.name
    assert [(a["name"], a["dtype"], a["shape"]) for a in description["inputs"]] == [
        ("tokens_BT", "int32", [4, 16]), ("lengths_B", "int32", [4]),
        ("temperature_B", "float32", [4]), ("top_p_B", "float32", [4]),
        ("seed_B", "uint32", [4])]
    assert [(a["name"], a["dtype"], a["shape"]) for a in description["outputs"]] == [
        ("output_tokens", "int32", [4, 24]), ("num_tokens_B", "int32", [4])]
    assert description["platforms"] == ["cpu", "cuda"]
    assert description["eos_token_id"] is None and description["model"]["config"]["d_model"] == 128
    assert description["tokenizer"]["files"] == [f"{out.name}.tokenizer.json"]
    assert description["tokenizer"]["kind"] == "char"
    assert Path(f"{out}.tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out.parent.glob(f"{out.name}*")} == \
        {0o666 & ~umask}  # the umask's, not a temporary file's private mode
    gpt2 = json.loads(Path(f"{exported['cases']['gpt2'][-1]}.json").read_text())
    assert gpt2["eos_token_id"] == exported["cases"]["gpt2"][3] and gpt2["tokenizer"] is None
    assert gpt2["platforms"] == [jax.default_backend()]


def test_the_program_never_calls_the_cpu_kernel(exported, config):
    """Exported inside `portable()` the attention is XLA's; traced without it, jax refuses to
    export the kernel's custom call (no file that only this process could run)."""
    program = exported["gpt2_program"]
    assert paged_attention.TARGET.encode() not in program.mlir_module_serialized
    fn = export.generation_fn(quick_params(config), config, batch=2, max_new_tokens=8)
    with pytest.raises(ValueError, match="gpt_jax_paged_decode_attention"):
        jax.export.export(jax.jit(fn))(*export.input_specs(2, 8))


BAD_FLAGS = [
    (["--batch", "0"], r"--batch 0 is out of range; allowed: an int >= 1"),
    (["--prompt-len", "100", "--max-new-tokens", "29"],
     r"--prompt-len 100 \+ --max-new-tokens 29 = 129 exceeds the model's max_seq_len 128; "
     r"allowed: a sum of at most 128"),
    (["--max-new-tokens", "-1"], r"--max-new-tokens -1 is out of range; allowed: an int >= 1"),
    (["--platforms", "cpu,gpu"], r"--platforms 'cpu,gpu' is not allowed; allowed: one or more "
                                 r"of cpu, cuda, rocm, tpu, each once"),
    (["--platforms", "cpu,cpu"], r"--platforms 'cpu,cpu' is not allowed"),
    (["--platforms", ""], r"--platforms '' is not allowed"),  # was the default, silently
    (["--out", "."], r"--out \S+ is a directory; allowed: a file path"),
    # a file where a folder of the path must go (found by a new user: a traceback, and only
    # after the export had run)
    (["--out", "config.json/sub/out.jaxexport"],
     r"--out \S+: \S+/config.json is a file, not a directory; allowed: a path under a "
     r"writable directory"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_cli_input_is_refused_before_the_weights_are_read(tmp_path, config, flags, message):
    """Each names the flag (a new user's trial: they named the Python parameter, `batch=0`,
    which the API still names)."""
    checkpoint.save_config(tmp_path, config)  # no checkpoint: reading weights would fail
    out = tmp_path / "out.jaxexport"
    args = {"--out": str(out), "--batch": "2", "--prompt-len": "8", "--max-new-tokens": "8"}
    for flag, value in zip(flags[::2], flags[1::2]):
        args[flag] = str(tmp_path / value) if flag == "--out" else value
    argv = ["export", "--run-dir", str(tmp_path)] + [x for item in args.items() for x in item]
    with pytest.raises(SystemExit, match=f"^gpt-jax export: {message}"):
        gpt_jax_cli.main(argv)
    assert not out.exists()


def test_the_api_names_its_parameters(config):
    with pytest.raises(ValueError, match=r"^batch=0 is out of range; allowed: an int >= 1$"):
        export.check_shape(config, 0, 8, 8)
    with pytest.raises(ValueError, match=r"^platforms='gpu' is not allowed"):
        export.check_shape(config, 1, 8, 8, ("gpu",))


def test_export_has_no_quantize_flag(tmp_path, config, capsys):
    """Fault (found by a new user): `export --quantize int8` was accepted (the flag came with
    the shared model flags) and wrote the float32 program byte for byte. The exported
    weights are float (--dtype); asking for int8 is an argparse error naming the flag."""
    checkpoint.save_config(tmp_path, config)
    with pytest.raises(SystemExit) as stop:
        gpt_jax_cli.main(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "x"),
                          "--batch", "1", "--prompt-len", "4", "--max-new-tokens", "4",
                          "--quantize", "int8"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --quantize int8" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_failed_write_leaves_no_file(tmp_path, config):
    class Failing:
        def serialize(self):
            raise OSError("disk full")

    out = tmp_path / "out.jaxexport"
    with pytest.raises(OSError, match="disk full"):
        export.write_export(Failing(), out, config, eos_token_id=None, source="test",
                            dtype="float32", tokenizer={})
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_after_the_export_is_one_line_and_leaves_no_file(
        exported, tmp_path, monkeypatch, capsys):
    """Fault (found by a new user): a path the checks cannot foresee as unwritable (under
    /proc, a full disk) ended the command in an OSError traceback."""
    def refuse(path, write):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(checkpoint, "write_atomic", refuse)
    out = tmp_path / "out.jaxexport"
    with pytest.raises(SystemExit, match=rf"^gpt-jax export: cannot write --out {out}: "
                                         r"\[Errno 30\] Read-only file system"):
        gpt_jax_cli.main(["export", "--run-dir", str(exported["folder"] / "char-run"),
                          "--out", str(out), "--batch", "1", "--prompt-len", "4",
                          "--max-new-tokens", "4"])
    assert list(tmp_path.iterdir()) == []


def test_a_hugging_face_tokenizer_is_copied_beside_the_program(exported, tmp_path):
    """`tokenizer.json` when the directory has it, else `vocab.json` + `merges.txt`."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "vocab.json").write_text('{"a": 0}')
    (hf_dir / "merges.txt").write_text("#version: 0.2\n")
    args = argparse.Namespace(hf_checkpoint=str(hf_dir), run_dir=None)
    out = tmp_path / "gpt2.jaxexport"
    description = export.write_export(
        exported["gpt2_program"], out, GPT2_SHAPED, eos_token_id=None, source=str(hf_dir),
        dtype="float32", tokenizer=export.tokenizer_files(args), tokenizer_kind="bpe")
    assert description["tokenizer"]["files"] == [f"{out.name}.vocab.json",
                                                 f"{out.name}.merges.txt"]
    assert "merges" in description["tokenizer"]["how"]
    assert Path(f"{out}.merges.txt").read_text() == "#version: 0.2\n"
    (hf_dir / "tokenizer.json").write_text("{}")
    assert export.tokenizer_files(args) == {"tokenizer.json": hf_dir / "tokenizer.json"}
