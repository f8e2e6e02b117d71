"""A TFDS name, "tfds:NAME" or "tfds:NAME:SPLIT": `tfds.load(NAME, split=SPLIT, as_supervised=True)`."""

from gpupar.data import tfds
from gpupar.data.adapters.dataset import DatasetAdapter
from gpupar.errors import GpuparError

PREFIX = "tfds:"


class TfdsAdapter(DatasetAdapter):
    """A TFDS data set by name, loaded once the strategy exists; the split "train" for training and "test" for evaluation."""

    def __init__(self, data, role: str, class_weight=None):
        if not data.startswith(PREFIX):
            raise GpuparError(f"{role}={data!r}: a name of a data set must look like 'tfds:mnist' or "
                              "'tfds:cifar10:train'")
        parts = data[len(PREFIX):].split(":", 1)
        self.name = parts[0]
        self.split = parts[1] if len(parts) == 2 else ("train" if role == "x" else "test")
        super().__init__(data, role, class_weight)
        self.form = "a TFDS name"

    @classmethod
    def takes(cls, data) -> bool:
        return isinstance(data, str)

    def prepare(self, input_options, seed: int):
        self.data = tfds.load(self.name, self.split)
        super().prepare(input_options, seed)

    def _describe(self, count) -> str:
        return f"TFDS {self.name}, split {self.split}"
