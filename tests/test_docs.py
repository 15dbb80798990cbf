"""The READMEs and benchmarks/results/ agree: every result file a README names exists, every
file there is named by a README, and an earlier run quoted "in git history" names a commit
that holds it (older runs leave the folder; the text keeps the figures and where to find them).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
READMES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "training" / "README.md"]

# "(in git history: 63d0e52 `benchmarks/results/x.json`)": a commit, then the file's path in it.
HISTORY = re.compile(r"\b([0-9a-f]{7,40})\s+`?(benchmarks/results/[\w.-]*\w)`?")
# A cited result: `results/NAME.json`, `benchmarks/results/NAME.{json,png}`. Placeholders
# (`results/NAME.json`) start with a capital and are not file names.
CITED = re.compile(r"(?<![\w/])(?:benchmarks/)?results/([a-z0-9][\w.{},-]*[\w}])")


def expand(name: str) -> list[str]:
    """`a.{json,png}` -> [`a.json`, `a.png`] (one brace group, as the READMEs write it)."""
    m = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
    if m is None:
        return [name]
    return [m[1] + part + m[3] for part in m[2].split(",")]


def readme_texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in READMES}


def history_refs() -> list[tuple[str, str, str]]:
    return [(readme, m[1], m[2]) for readme, text in readme_texts().items()
            for m in HISTORY.finditer(text)]


def cited() -> dict[str, set[str]]:
    """file name under benchmarks/results -> the READMEs naming it (history refs excluded)."""
    names: dict[str, set[str]] = {}
    for readme, text in readme_texts().items():
        for m in CITED.finditer(HISTORY.sub("", text)):
            for name in expand(m[1]):
                names.setdefault(name, set()).add(readme)
    return names


def test_every_cited_result_exists():
    missing = {name: sorted(where) for name, where in cited().items()
               if not (RESULTS / name).is_file()}
    assert not missing, f"named in a README, not in benchmarks/results: {missing}"


def test_every_result_is_cited():
    names = cited()
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in names)
    assert not uncited, f"in benchmarks/results, named by no README: {uncited}"


def test_history_refs_name_a_commit_holding_the_file():
    refs = history_refs()
    assert refs, "the READMEs quote earlier runs; their refs should parse"
    git = ["git", "-C", str(ROOT)]
    if subprocess.run([*git, "rev-parse", "--git-dir"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    wrong = []
    for readme, commit, path in refs:
        if subprocess.run([*git, "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode:
            continue  # a shallow clone lacks the commit; nothing to check against
        if subprocess.run([*git, "cat-file", "-e", f"{commit}:{path}"],
                          capture_output=True).returncode:
            wrong.append((readme, commit, path))
    assert not wrong, f"commit does not hold the file: {wrong}"


def test_every_benchmark_name_is_listed_in_both_readmes():
    """`gpt-jax bench --help`'s names all appear in README's list and benchmarks/README's
    table (a new user found four missing from the list)."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench
    names = bench.benchmark_names()
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("`gpt-jax bench NAME` runs a benchmark"):]
    listed = listed[:listed.index(")")]
    table = (ROOT / "benchmarks" / "README.md").read_text()
    assert [n for n in names if f"`{n}`" not in listed] == []
    assert [n for n in names if f"| `{n}` |" not in table] == []



def test_the_readme_s_serve_block_lists_every_serve_flag_and_nothing_else(capsys):
    """Fault: a merge pasted two lines of the benchmarks paragraph into README's `gpt-jax
    serve` block in place of its last flags line (--allowed-origins, --no-warmup, ...)."""
    from inference.serve import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]  # the usage lines: every flag once
    multihost = {"--coordinator", "--num-processes", "--process-id", "--heartbeat-timeout-s"}
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", usage)) - multihost
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(gpt-jax serve --run-dir .*?)```", text, re.S)[1]
    assert all(line.startswith("  [") for line in block.splitlines()[1:]), block
    assert flags <= set(re.findall(r"--[a-z][a-z0-9-]*", block)), block
