"""`training/config.py`: `TrainConfig` refuses an unknown preset or field, and a value out
of range or not finite, by name."""

import math

import pytest

from training import train as T
from training.config import TrainConfig


def test_unknown_preset_or_field_is_refused(capsys):
    with pytest.raises(ValueError, match=r"unknown TrainConfig preset 'nanogpt'; choose one of "
                                         r"\['nanogpt-cpu', 'shakespeare-char', 'tiny'\]"):
        TrainConfig.preset("nanogpt")
    with pytest.raises(ValueError, match=r"unknown TrainConfig field\(s\) \['lr'\]; fields "
                                         r"are \['model', "):
        TrainConfig.preset("tiny", lr=1e-3)
    with pytest.raises(SystemExit):
        T.config_from_args(["--lr", "1e-3"])
    assert "Unrecognized options: --lr" in capsys.readouterr().err  # tyro's words
    with pytest.raises(ValueError, match=r"TrainConfig.compute_dtype must be one of "
                                         r"\('float32', 'bfloat16'\), got 'float16'"):
        TrainConfig.preset("tiny", compute_dtype="float16")
    with pytest.raises(ValueError, match="TrainConfig.grad_accum must be > 0, got 0"):
        TrainConfig.preset("tiny", grad_accum=0)

@pytest.mark.parametrize("name, value", [("time_budget_s", math.nan), ("time_budget_s", math.inf),
                                         ("learning_rate", math.inf), ("weight_decay", math.nan)])
def test_non_finite_numbers_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=rf"^TrainConfig.{name} must be a finite number, "
                                         rf"got {value}$"):
        TrainConfig(**{name: value})
