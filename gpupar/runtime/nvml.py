"""NVML's view of the GPUs, and which NVML device each of TensorFlow's GPUs is.

NVML numbers GPUs in PCI bus order and sees every GPU of the machine; TensorFlow numbers the
GPUs CUDA shows it: those CUDA_VISIBLE_DEVICES leaves (by index or UUID), in CUDA's order, which
is "fastest first" unless CUDA_DEVICE_ORDER=PCI_BUS_ID (gpupar sets that default when it is
imported, before TensorFlow starts). `match_visible` maps TensorFlow's GPU indices to NVML devices
from those settings alone (before TensorFlow starts: for memory_fraction); once TensorFlow runs,
`match_by_bus_id` matches them by PCI bus id, which holds whatever the settings. On a MIG device
the handle is the parent card, whose utilisation NVML does not report. The decisions are pure;
`read_gpus` and `tf_bus_ids` read NVML and TensorFlow.
"""

import dataclasses
import re
from typing import List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML reports it.

    Attributes:
      index: NVML's index (PCI bus order).
      bus_id: The PCI bus id, as "0000:17:00.0".
      uuid: "GPU-..."
      name: The product name.
      total_mb: Memory in MiB.
      free_mb: Memory not in use, in MiB, when read.
      mig: Whether MIG mode is on (NVML then reports no utilisation for the card).
    """

    index: int
    bus_id: str
    uuid: str = ""
    name: str = ""
    total_mb: Optional[int] = None
    free_mb: Optional[int] = None
    mig: bool = False


def normalise_bus_id(text: str) -> str:
    """NVML's "00000000:17:00.0" and TensorFlow's "0000:17:00.0" as one form: the last 4 domain digits, lower case."""
    match = re.search(r"([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", text or "")
    if not match:
        return ""
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def match_by_bus_id(tf_bus_ids: Sequence[Optional[str]], gpus: Sequence[NvmlGpu]) -> List[Optional[NvmlGpu]]:
    """For each of TensorFlow's GPUs (by its PCI bus id), the NVML device at that bus id, or None."""
    by_bus = {normalise_bus_id(g.bus_id): g for g in gpus}
    return [by_bus.get(normalise_bus_id(b)) if b else None for b in tf_bus_ids]


def match_visible(num_tf_gpus: int, gpus: Sequence[NvmlGpu], cuda_visible_devices: Optional[str],
                  cuda_device_order: Optional[str]) -> List[Optional[NvmlGpu]]:
    """For each of TensorFlow's GPUs (by index), the NVML device it is, from CUDA's settings; None where unknown.

    CUDA_VISIBLE_DEVICES entries are indices in CUDA's order or UUIDs (MIG instances too); CUDA's
    order is NVML's only under CUDA_DEVICE_ORDER=PCI_BUS_ID, so in "fastest first" order an index
    tells nothing.
    """
    in_bus_order = sorted(gpus, key=lambda g: normalise_bus_id(g.bus_id))
    if cuda_visible_devices is None:
        entries = [str(i) for i in range(len(in_bus_order))]
    else:
        entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    by_uuid = {g.uuid: g for g in gpus if g.uuid}
    pci_order = (cuda_device_order or "FASTEST_FIRST").upper() == "PCI_BUS_ID"
    matched = []
    for entry in entries[:num_tf_gpus]:
        if entry.isdigit():
            matched.append(in_bus_order[int(entry)] if pci_order and int(entry) < len(in_bus_order) else None)
        else:
            matched.append(by_uuid.get(entry))  # a MIG id ("MIG-...") is not a card's UUID: None
    return matched + [None] * (num_tf_gpus - len(matched))


def read_gpus(nvml) -> List[NvmlGpu]:
    """Every GPU NVML sees (nvml: the pynvml module, or a fake in tests); [] when NVML cannot start."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                mig = nvml.nvmlDeviceGetMigMode(handle)[0] == 1
            except nvml.NVMLError:  # no MIG support on this card
                mig = False
            gpus.append(NvmlGpu(i, _text(nvml.nvmlDeviceGetPciInfo(handle).busId), _text(nvml.nvmlDeviceGetUUID(handle)),
                                _text(nvml.nvmlDeviceGetName(handle)), int(memory.total) // 2**20,
                                int(memory.free) // 2**20, mig))
        return gpus
    finally:
        nvml.nvmlShutdown()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def installed_nvml():
    """The pynvml module of nvidia-ml-py, or None where it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def tf_bus_ids() -> List[Optional[str]]:
    """The PCI bus id of each of TensorFlow's GPUs, from its device descriptions; starts TensorFlow's runtime.

    device_lib makes its devices anew from the config it is given, and TensorFlow keeps the memory
    allocator that the first device made of each GPU. So the runtime starts first (with the
    configured growth and limits) and device_lib gets the runtime's config: with the default one
    it would make the GPUs the runtime hides with default settings (taking all their memory), or
    fail on them ("being mapped to multiple devices").
    """
    import tensorflow as tf

    from gpupar import keras_compat

    tf.config.list_logical_devices("GPU")  # starts the runtime with the configured settings
    found = []
    for description in keras_compat.gpu_descriptions():
        match = re.search(r"pci bus id: ([0-9a-fA-F:.]+)", description)
        found.append(match.group(1) if match else None)
    return found
