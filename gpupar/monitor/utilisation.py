"""GPU-Util and GPU memory sampled through NVML while training runs, summarised per epoch.

Memory full while GPU-Util sits near 0% is the sign of input-bound training; these numbers put it
in the log next to the input-wait monitor's. NVML comes from the optional nvidia-ml-py package
(`pip install 'gpupar[nvml]'`).
"""

import dataclasses
import os
import statistics
import threading
from typing import Optional, Sequence

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
    """One GPU over an epoch: mean and lowest GPU-Util, highest memory in use."""

    gpu: int
    mean_util_percent: float
    min_util_percent: float
    max_memory_used_mb: float
    memory_total_mb: float
    samples: int

    def describe(self) -> str:
        return (f"gpu{self.gpu}: GPU-Util {self.mean_util_percent:.0f}% mean (lowest {self.min_util_percent:.0f}%), "
                f"memory {self.max_memory_used_mb:,.0f} / {self.memory_total_mb:,.0f} MiB at most, "
                f"{self.samples} samples")


def summarise(samples: Sequence[GpuSample]) -> list:
    """The per-GPU summaries of some samples, in GPU order."""
    by_gpu = {}
    for sample in samples:
        by_gpu.setdefault(sample.gpu, []).append(sample)
    return [
        GpuSummary(gpu, statistics.fmean(s.util_percent for s in group), min(s.util_percent for s in group),
                   max(s.memory_used_mb for s in group), group[0].memory_total_mb, len(group))
        for gpu, group in sorted(by_gpu.items())
    ]


def nvml_indices(visible_gpus: Sequence[int], cuda_visible_devices: Optional[str]):
    """NVML's indices of the GPUs TensorFlow numbers visible_gpus, or None when they cannot be told.

    TensorFlow counts the GPUs that CUDA_VISIBLE_DEVICES leaves, NVML counts them all; entries
    that are not plain indices (GPU UUIDs, MIG names) cannot be mapped here.
    """
    if cuda_visible_devices is None:
        return tuple(visible_gpus)
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries) or any(i >= len(entries) for i in visible_gpus):
        return None
    return tuple(int(entries[i]) for i in visible_gpus)


def sampling_decision(visible_gpus: Sequence[int], nvml_installed: bool, cuda_visible_devices: Optional[str] = None):
    """(NVML indices to sample or None, message): sample the GPUs in use when NVML can see them."""
    if not visible_gpus:
        return None, "GPU utilisation: no GPU in use, nothing to sample"
    if not nvml_installed:
        return None, ("GPU utilisation: not sampled; install nvidia-ml-py (pip install 'gpupar[nvml]') to log "
                      "GPU-Util and memory per epoch")
    indices = nvml_indices(visible_gpus, cuda_visible_devices)
    if indices is None:
        return None, (f"GPU utilisation: not sampled; CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} does not map "
                      "TensorFlow's GPUs to NVML indices (give plain indices)")
    return indices, f"GPU utilisation: sampling NVML GPU(s) {', '.join(map(str, indices))} every {INTERVAL_SECONDS} s"


class GpuSampler:
    """A background thread reading GPU-Util and memory of some GPUs through NVML."""

    def __init__(self, nvml, gpus: Sequence[int], interval: float = INTERVAL_SECONDS):
        self.nvml, self.interval = nvml, interval
        nvml.nvmlInit()
        try:
            self.handles = [(gpu, nvml.nvmlDeviceGetHandleByIndex(gpu)) for gpu in gpus]
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
                    util = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
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
    """A running sampler of the visible GPUs, or None (with the reason logged) where none can run."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    indices, message = sampling_decision(visible_gpus, pynvml is not None, os.environ.get("CUDA_VISIBLE_DEVICES"))
    log.info(message)
    if indices is None:
        return None
    try:
        return GpuSampler(pynvml, indices)
    except pynvml.NVMLError as e:
        log.info("GPU utilisation: NVML failed (%s); not sampled", e)
        return None
