"""The MFU denominator: GPUs' published peaks, the CPU's measured one (best of several trials, kept in
a file so that every run divides by the same number, measured again on request)."""
import json
import os

import pytest
import torch

from minipar import hardware
from minipar.hardware import Peak, cache_key, calibrate_peak, measured_matmul_flops, peak, peak_flops


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache file, in a fresh XDG_CACHE_HOME: no test reads what another run left."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "minipar" / "peak.json"


def test_the_best_of_several_trials_spread_over_time():
    n = 16
    durations = [0.4, 0.1, 0.3, 0.2]  # the second trial met a quiet moment
    times = iter([0.0] + [t for i in range(4) for t in (sum(durations[:i]), sum(durations[:i + 1]))])
    flops = measured_matmul_flops(n=n, seconds=1.0, trials=2, clock=lambda: next(times))
    assert flops == pytest.approx(2 * n ** 3 / 0.1)  # the fastest trial's rate
    assert next(times, "all used") == "all used"  # it ran until 1 s had passed, not just 2 trials


def test_a_measurement_is_cached_reused_and_redone_on_request(cache, monkeypatch):
    first = peak("cpu")
    assert first.flops > 0 and cache.exists()
    (key, entry), = json.loads(cache.read_text()).items()
    assert key == cache_key("cpu", torch.float32) and entry["flops"] == first.flops
    assert f"measured {entry['date']} at load" in first.source and "cached in" in first.source
    cache.write_text(json.dumps({key: dict(flops=123.0, date="2020-01-02", load=0.4)}))
    reused = peak("cpu")  # no measurement: the file's value, and where it comes from
    assert reused == Peak(123.0, f"CPU fp32 matmul, measured 2020-01-02 at load 0.4 (cached in "
                                 f"{cache}; --recalibrate-peak to redo)")
    assert peak_flops("cpu") == 123.0
    busy = dict(flops=12.0, date="2020-01-02", load=64.0 * os.cpu_count())
    cache.write_text(json.dumps({key: busy}))  # measured while the cores were busy, quieter now:
    redone = peak("cpu")                         # measured again
    assert redone.flops != 12.0 and "2020-01-02" not in redone.source
    monkeypatch.setattr(hardware, "_load", lambda: 64.0 * os.cpu_count())  # as busy now as then:
    cache.write_text(json.dumps({key: busy}))                              # kept, and said so
    assert "cores were busy, it may read low" in peak("cpu").source
    assert peak("cpu", torch.bfloat16) == peak("cpu")  # a CPU's peak is fp32's, whatever the precision
    again = calibrate_peak("cpu")
    assert again.flops != 123.0 and "2020-01-02" not in again.source
    assert json.loads(cache.read_text())[key]["flops"] == again.flops == peak_flops("cpu")


def test_a_broken_cache_file_is_measured_over(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert peak("cpu").flops > 0
    assert json.loads(cache.read_text())  # rewritten whole


def test_the_key_holds_what_a_measurement_depends_on():
    threads = torch.get_num_threads()
    key = cache_key("cpu", torch.float32)
    assert key.startswith(f"cpu fp32 threads={threads} ") and hardware._cpu_model() in key
    assert cache_key("cpu", torch.bfloat16) != key
    try:
        torch.set_num_threads(threads + 1)
        assert cache_key("cpu", torch.float32) != key  # more threads: another peak
    finally:
        torch.set_num_threads(threads)


def test_gpus_use_the_published_peak():
    assert hardware.published_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == Peak(
        989e12, "H100 dense bf16, published")
    assert hardware.published_peak("NVIDIA A100-SXM4-80GB", torch.float32).flops == 156e12
    assert hardware.published_peak("Some Future GPU", torch.bfloat16) is None


def test_the_cache_honours_xdg_and_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hardware.cache_path() == tmp_path / "minipar" / "peak.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hardware.cache_path() == tmp_path / "home" / ".cache" / "minipar" / "peak.json"
    assert hardware._shown(hardware.cache_path()) == "~/.cache/minipar/peak.json"
