"""GPU utilisation sampling: the decision, the summaries, and the sampler against a fake NVML."""

import logging
import time
import types

from gpupar.monitor import utilisation
from gpupar.monitor.utilisation import GpuSample


def test_decision_says_why_nothing_is_sampled_and_what_mig_leaves_out():
    from gpupar.runtime.nvml import NvmlGpu

    cards = [NvmlGpu(2, "0000:3b:00.0"), NvmlGpu(0, "0000:17:00.0", mig=True)]
    assert utilisation.sampling_decision(0, [], nvml_installed=True) == ([], "GPU utilisation: no GPU in use, nothing to sample")
    gpus, message = utilisation.sampling_decision(2, cards, nvml_installed=False)
    assert gpus == [] and "pip install 'gpupar[nvml]'" in message
    gpus, message = utilisation.sampling_decision(3, [*cards, None], nvml_installed=True)
    assert [g.index for g in gpus] == [2, 0] and "1 GPU(s) not matched to NVML" in message
    assert "GPU(s) 0 in MIG mode: memory only" in message
    assert utilisation.sampling_decision(1, [None], nvml_installed=True)[0] == []


def test_summaries_per_gpu():
    samples = [GpuSample(1, 0.0, 9000, 16000), GpuSample(0, 80.0, 1000, 8000), GpuSample(1, 10.0, 15000, 16000),
               GpuSample(0, 100.0, 1200, 8000)]
    first, second = utilisation.summarise(samples)
    assert (first.gpu, first.mean_util_percent, first.min_util_percent, first.max_memory_used_mb) == (0, 90.0, 80.0, 1200)
    assert (second.gpu, second.mean_util_percent, second.max_memory_used_mb, second.samples) == (1, 5.0, 15000, 2)
    assert second.describe() == "gpu1: GPU-Util 5% mean (lowest 0%), memory 15,000 / 16,000 MiB at most, 2 samples"


class _FakeNvml:
    """The part of pynvml the sampler uses; GPU 1 fails every other reading."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.calls, self.shut_down = 0, False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.calls += handle == 1
        if handle == 1 and self.calls % 2:
            raise self.NVMLError("lost")
        return types.SimpleNamespace(gpu=30 + 10 * handle, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=(handle + 1) * 2**30, total=8 * 2**30)


def test_sampler_reads_each_gpu_and_skips_failed_readings():
    nvml = _FakeNvml()
    from gpupar.runtime.nvml import NvmlGpu

    sampler = utilisation.GpuSampler(nvml, (NvmlGpu(0, "0000:17:00.0"), NvmlGpu(1, "0000:3b:00.0")), interval=0.01)
    time.sleep(0.2)
    summaries = sampler.take()
    sampler.stop()
    assert [s.gpu for s in summaries] == [0, 1] and nvml.shut_down
    assert summaries[0].mean_util_percent == 30 and summaries[1].mean_util_percent == 40
    assert summaries[0].max_memory_used_mb == 1024 and summaries[1].memory_total_mb == 8192
    assert summaries[0].samples > 3 and 0 < summaries[1].samples < summaries[0].samples
    assert sampler.take() == []  # take() empties the buffer


def test_training_here_says_there_is_no_gpu_to_sample(shared_idx_dir, capsys):
    import gpupar

    result = gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=64, steps_per_epoch=2)
    assert "GPU utilisation: no GPU in use, nothing to sample" in capsys.readouterr().out
    assert result.records[0].gpu_util_percent is None


def test_start_sampler_logs_its_decision(caplog):
    with caplog.at_level(logging.INFO):
        assert utilisation.start_sampler((), logging.getLogger("test")) is None
    assert "no GPU in use" in caplog.text
