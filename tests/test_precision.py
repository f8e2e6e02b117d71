"""The fast number format and the steps per call: pure decisions from made-up devices and timings, then in a run."""

import keras
import numpy as np
import pytest

import gpupar
from gpupar.runtime.precision import cpu_flags, plan_precision
from gpupar.training.inner_loop import Results
from gpupar.training.observers import CallEnd, StepsPerCallTuner, steps_per_call_for


@pytest.mark.parametrize("cpu, gpus, precision", [
    (("avx2", "amx_bf16", "amx_tile"), (), "mixed_bfloat16"),       # Sapphire Rapids and later
    (("avx2", "avx512_bf16"), (), "mixed_bfloat16"),                # Cooper Lake, Zen 4
    (("avx2", "avx512f"), (), "float32"),                           # no bfloat16 units
    ((), ((8, 0), (8, 6)), "mixed_bfloat16"),                       # A100 and an A-series card
    (("amx_bf16",), ((9, 0),), "mixed_bfloat16"),                   # H100: the GPUs decide
    ((), ((7, 0), (7, 5)), "mixed_float16"),                        # V100, T4: float16 tensor cores
    ((), ((8, 0), (7, 5)), "mixed_float16"),                        # the slowest GPU decides
    (("amx_bf16",), ((6, 1),), "float32"),                          # Pascal: no 16-bit matrix units
    ((), ((8, 0), None), "float32"),                                # a GPU of unknown capability
])
def test_the_fast_format_is_planned_from_the_devices(cpu, gpus, precision):
    plan = plan_precision(cpu, gpus)
    assert plan.precision == precision and plan.reason
    assert plan.fast == (precision != "float32")


def test_the_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx512_bf16 amx_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(cpuinfo)) == ("fpu", "sse2", "avx512_bf16", "amx_bf16")
    assert cpu_flags(str(tmp_path / "none")) == ()


def _model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n=512):
    x = np.random.default_rng(0).normal(size=(n, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def test_auto_picks_this_machines_format_and_fit_keeps_float32_saying_so(capsys, monkeypatch):
    from gpupar.training import setup

    monkeypatch.setattr(setup, "machine_precision", lambda gpus: plan_precision(("amx_bf16",)))
    monkeypatch.setattr(setup, "_HINTED", set())
    auto = gpupar.fit(_model, *_data(), batch_size=64, precision="auto", save=False, verbose=2)
    assert auto.model.layers[0].compute_dtype == "bfloat16"
    plain = gpupar.fit(_model, *_data(), batch_size=64, save=False, verbose=2)
    assert plain.model.layers[0].compute_dtype == "float32"
    gpupar.fit(_model, *_data(), batch_size=64, save=False, verbose=2)
    out = capsys.readouterr().out
    assert "precision: auto chose mixed_bfloat16: the CPU has bfloat16 matrix units (AMX_BF16)" in out
    assert out.count("so mixed_bfloat16 may train faster") == 1  # once per process
    monkeypatch.setattr(setup, "machine_precision", lambda gpus: plan_precision(("avx2",)))
    assert gpupar.fit(_model, *_data(), batch_size=64, precision="auto", save=False).model.layers[
        0].compute_dtype == "float32"


def test_auto_keeps_float32_where_the_step_is_a_modes_own_or_the_model_is_built(capsys, monkeypatch):
    from gpupar.training import setup

    monkeypatch.setattr(setup, "machine_precision", lambda gpus: plan_precision(("amx_bf16",)))
    built = _model()
    assert gpupar.fit(built, *_data(), batch_size=64, precision="auto", save=False, verbose=2).model is built
    assert "auto chose float32: the model is built already" in capsys.readouterr().out


@pytest.mark.parametrize("overhead, step, most, expected", [
    (1e-3, 1e-3, 1000, 20),      # the host's work as long as a step: 20 steps make it 5%
    (2e-3, 1e-4, 1000, 400),     # a tiny step on a fast device wants many
    (2e-3, 1e-4, 50, 50),        # never more than an epoch (or the cap)
    (1e-4, 0.5, 1000, 1),        # a large step wants one
    (-1e-4, 1e-3, 1000, 1),      # timing noise below zero: one
])
def test_steps_per_call_are_picked_from_the_overhead_against_the_step(overhead, step, most, expected):
    assert steps_per_call_for(overhead, step, most) == expected


def test_the_tuner_times_whole_call_cycles_after_the_traced_one_then_picks_once(monkeypatch, caplog):
    caplog.set_level("INFO", "gpupar")
    # Each call starts 12 ms after the one before; its steps took 2 ms in the graph: 10 ms on the host.
    starts = iter([0.0, 1.0, 1.012, 1.024, 1.036])  # the first call traces (1 s): its cycle is left out
    monkeypatch.setattr("gpupar.training.observers.time.perf_counter", lambda: next(starts))
    tuner = StepsPerCallTuner(most=500, probe_steps=2)
    for _ in range(4):
        assert tuner.call_size(0, 100) == 2
        tuner.on_call_begin(0, 0)
        tuner.on_call_end(CallEnd(0, 0, 2, Results(steps=2, waited=0.0, busy=0.002), dict))
    tuner.on_call_begin(0, 0)
    assert tuner.chosen == steps_per_call_for(0.010, 0.001, 500) == 200
    assert tuner.call_size(0, 1000) == 200 and tuner.call_size(0, 7) == 7  # an epoch's end still cuts it
    assert "steps per call: auto chose 200" in caplog.text


def test_the_tuner_decides_at_a_short_epochs_end_from_what_it_measured(monkeypatch):
    starts = iter([0.0, 1.0, 1.012])
    monkeypatch.setattr("gpupar.training.observers.time.perf_counter", lambda: next(starts))
    tuner = StepsPerCallTuner(most=500)
    for _ in range(3):
        tuner.on_call_begin(0, 0)
        tuner.on_call_end(CallEnd(0, 0, 2, Results(steps=2, waited=0.0, busy=0.002), dict))
    tuner.on_epoch_end(None, None, [])
    assert tuner.chosen == 200


def test_steps_per_call_auto_trains_as_fixed_calls_do(caplog):
    caplog.set_level("INFO", "gpupar")
    x, y = _data(2048)
    options = dict(batch_size=32, epochs=2, shuffle=False, save=False, seed=1)
    tuned = gpupar.fit(_model, x, y, steps_per_call="auto", **options)
    fixed = gpupar.fit(_model, x, y, steps_per_call=7, **options)
    assert "steps per call: auto chose" in caplog.text
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(tuned.model.get_weights(), fixed.model.get_weights())) < 1e-5


def test_steps_per_call_takes_auto_or_a_whole_number():
    assert gpupar.Config(steps_per_call="auto").loop.steps_per_call == "auto"
    assert gpupar.Config(steps_per_call="12").loop.steps_per_call == 12  # as a flag gives it
    with pytest.raises(gpupar.GpuparError, match="steps_per_call='fast': must be a whole number >= 1, or auto"):
        gpupar.Config(steps_per_call="fast")


def test_diagnose_measures_float32_against_the_fast_format_from_the_same_weights(monkeypatch):
    from gpupar.commands import diagnose

    monkeypatch.setattr(diagnose, "machine_precision", lambda gpus: plan_precision(("amx_bf16",)))
    report = gpupar.diagnose(_model, *_data(2048), batch_size=64, steps=8)
    assert list(report.precisions) == ["float32", "mixed_bfloat16"]
    plain, fast = report.precisions["float32"], report.precisions["mixed_bfloat16"]
    assert plain["examples_per_second"] > 0 and fast["examples_per_second"] > 0
    assert fast["loss"] == pytest.approx(plain["loss"], rel=0.05) and fast["loss"] != plain["loss"]  # bf16 rounds
    assert "number format: mixed_bfloat16 at " in report.format() and "x float32's rate" in report.format()
    monkeypatch.setattr(diagnose, "machine_precision", lambda gpus: plan_precision(("avx2",)))
    assert gpupar.diagnose(_model, *_data(2048), batch_size=64, steps=8).precisions == {}
