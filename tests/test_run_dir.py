"""`training/run_dir.py`: a run directory refuses to resume with another model or
tokenizer than it was started with."""

import dataclasses
import json

import pytest

from training.config import TrainConfig
from training.run_dir import prepare_run


@pytest.mark.parametrize("started_with, resumed_with", [
    ({}, {"model": "tiny"}),
    ({}, {"tokenizer": "bpe"}),  # fault: trained on as char, recorded as bpe
    ({"tokenizer": "bpe"}, {"tokenizer": "bpe", "bpe_vocab_size": 300}),
], ids=["model", "tokenizer", "bpe-vocab-size"])
def test_resuming_with_another_model_or_tokenizer_is_refused(corpus, tmp_path, started_with,
                                                             resumed_with):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")  # a started run (never read: refused first)
    started = TrainConfig.preset("nanogpt-cpu", text=str(corpus), run_dir=str(run_dir),
                                 **started_with)
    (run_dir / "train_config.json").write_text(json.dumps(dataclasses.asdict(started)))
    (name, value), = [(k, v) for k, v in resumed_with.items() if v != started_with.get(k)]
    cfg = dataclasses.replace(started, **resumed_with)
    with pytest.raises(ValueError, match=rf"{run_dir} holds a run with {name} "
                                         rf"{getattr(started, name)!r}; it cannot resume with "
                                         rf"{name} {value!r} \(start a new --run-dir"):
        prepare_run(cfg)
    assert json.loads((run_dir / "train_config.json").read_text())[name] == \
        getattr(started, name)  # nothing recorded


def test_a_block_longer_than_the_context_is_refused_in_flags(corpus, tmp_path):
    """Fault: `gpt-jax train --block-size 100000` said `block_size 100000 exceeds the model's
    max_seq_len 128`, a name the command does not have, and not what it allows."""
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             block_size=100000)
    with pytest.raises(ValueError, match=r"^--block-size 100000 exceeds the model's max_seq_len "
                                         r"(\d+); allowed: 1 to \1, or 0 for the max_seq_len$"):
        prepare_run(cfg)
