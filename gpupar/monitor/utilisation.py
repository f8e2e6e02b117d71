"""GPU-Util and GPU memory sampled through NVML while training runs, summarised per epoch.

Memory full while GPU-Util sits near 0% is the sign of input-bound training; these numbers put it
in the log next to the input-wait monitor's. NVML comes from the optional nvidia-ml-py package
(`pip install 'gpupar[nvml]'`).
"""

import dataclasses
import math
import statistics
import threading
from typing import Optional, Sequence

from gpupar.runtime.nvml import NvmlGpu, installed_nvml, match_by_bus_id, read_gpus, tf_bus_ids

INTERVAL_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class GpuSample:
    """One NVML reading of one GPU (NVML index, PCI bus order)."""

    gpu: int
    util_percent: float
    memory_used_mb: float
    memory_total_mb: float


@dataclasses.dataclass(frozen=True)
class GpuSummary:
    """One GPU over an epoch: mean and lowest GPU-Util (None for a MIG card), highest memory in use."""

    gpu: int
    mean_util_percent: Optional[float]
    min_util_percent: Optional[float]
    max_memory_used_mb: float
    memory_total_mb: float
    samples: int

    def describe(self) -> str:
        util = ("GPU-Util not reported (MIG)" if self.mean_util_percent is None else
                f"GPU-Util {self.mean_util_percent:.0f}% mean (lowest {self.min_util_percent:.0f}%)")
        return (f"gpu{self.gpu}: {util}, memory {self.max_memory_used_mb:,.0f} / {self.memory_total_mb:,.0f} MiB at "
                f"most, {self.samples} samples")


def summarise(samples: Sequence[GpuSample]) -> list:
    """The per-GPU summaries of some samples, in GPU order."""
    by_gpu = {}
    for sample in samples:
        by_gpu.setdefault(sample.gpu, []).append(sample)
    summaries = []
    for gpu, group in sorted(by_gpu.items()):
        utils = [s.util_percent for s in group if not math.isnan(s.util_percent)]  # NaN: a MIG card's
        summaries.append(GpuSummary(gpu, statistics.fmean(utils) if utils else None, min(utils) if utils else None,
                                    max(s.memory_used_mb for s in group), group[0].memory_total_mb, len(group)))
    return summaries


def sampling_decision(in_use: int, matched: Sequence[Optional[NvmlGpu]], nvml_installed: bool):
    """(NVML devices to sample, message): the GPUs in use that NVML can be matched to, and what is left out.

    `in_use` is how many GPUs training uses; `matched`, the NVML device of each (by PCI bus id,
    gpupar.runtime.nvml), None where none matched. A MIG card is sampled for memory only: NVML
    reports no utilisation for its instances.
    """
    if not in_use:
        return [], "GPU utilisation: no GPU in use, nothing to sample"
    if not nvml_installed:
        return [], ("GPU utilisation: not sampled; install nvidia-ml-py (pip install 'gpupar[nvml]') to log "
                    "GPU-Util and memory per epoch")
    found = [gpu for gpu in matched if gpu is not None]
    if not found:
        return [], "GPU utilisation: not sampled; NVML shows no GPU at the PCI bus ids of TensorFlow's GPUs"
    notes = [f"NVML GPU(s) {', '.join(str(g.index) for g in found)} every {INTERVAL_SECONDS} s"]
    if len(found) < in_use:
        notes.append(f"{in_use - len(found)} GPU(s) not matched to NVML")
    mig = [str(g.index) for g in found if g.mig]
    if mig:
        notes.append(f"GPU(s) {', '.join(mig)} in MIG mode: memory only, NVML reports no GPU-Util for MIG instances")
    return found, "GPU utilisation: sampling " + "; ".join(notes)


class GpuSampler:
    """A background thread reading GPU-Util and memory of some GPUs through NVML."""

    def __init__(self, nvml, gpus: Sequence[NvmlGpu], interval: float = INTERVAL_SECONDS):
        self.nvml, self.interval = nvml, interval
        self.mig = {gpu.index for gpu in gpus if gpu.mig}
        nvml.nvmlInit()
        try:
            self.handles = [(gpu.index, nvml.nvmlDeviceGetHandleByIndex(gpu.index)) for gpu in gpus]
        except nvml.NVMLError:
            nvml.nvmlShutdown()
            raise
        self.samples, self.lock, self.stopped = [], threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._sample, name="gpupar-nvml", daemon=True)
        self.thread.start()

    def _sample(self):
        while not self.stopped.is_set():
            readings = []
            for gpu, handle in self.handles:
                try:
                    util = float("nan") if gpu in self.mig else self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                except self.nvml.NVMLError:
                    continue  # a reading that fails (e.g. a GPU lost) is skipped, not fatal
                readings.append(GpuSample(gpu, float(util), memory.used / 2**20, memory.total / 2**20))
            with self.lock:
                self.samples.extend(readings)
            self.stopped.wait(self.interval)

    def take(self) -> list:
        """The summaries of the samples since the last take."""
        with self.lock:
            samples, self.samples = self.samples, []
        return summarise(samples)

    def stop(self):
        self.stopped.set()
        self.thread.join()
        self.nvml.nvmlShutdown()


def start_sampler(visible_gpus: Sequence[int], log) -> Optional[GpuSampler]:
    """A running sampler of the GPUs in use, or None (with the reason logged) where none can run."""
    pynvml = installed_nvml()
    matched = match_by_bus_id(tf_bus_ids(), read_gpus(pynvml)) if visible_gpus and pynvml else []
    gpus, message = sampling_decision(len(visible_gpus), matched, pynvml is not None)
    log.info(message)
    if not gpus:
        return None
    try:
        return GpuSampler(pynvml, gpus)
    except pynvml.NVMLError as e:
        log.info("GPU utilisation: NVML failed (%s); not sampled", e)
        return None
