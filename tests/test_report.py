"""`training/report.py`: the progress bar's MFU peak."""

import types

from training import report, sharding


def test_the_mfu_peak_is_the_fastest_matmul_not_the_mean(monkeypatch):
    """Fault: on a machine other jobs loaded, the mean of five probe matmuls read 32 GFLOP/s
    where the cores reach ~150, and the progress bar showed MFU 77%. One quick rep among
    slow ones sets the peak."""
    clock = iter([0.0, 4.0, 4.0, 5.0, 5.0, 5.5, 6.0, 7.0, 8.0, 12.0])  # reps of 4, 1, 0.5, 1, 4 s
    monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    mesh = sharding.make_mesh(1)
    n = 64
    assert report.measure_peak_flops(mesh, n=n, reps=5) == 2.0 * n**3 / 0.5
