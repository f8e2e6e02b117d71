"""The input forms gpupar takes, one adapter class each, behind one `adapter_for(data, role)`.

Adding a form is one module with a DataAdapter subclass and one entry in FORMS.
"""

from gpupar.data.adapters.arrays import ArrayAdapter
from gpupar.data.adapters.adapter import DataAdapter
from gpupar.data.adapters.dataset import DatasetAdapter
from gpupar.data.adapters.dataset_fn import DatasetFnAdapter
from gpupar.data.adapters.tfds_name import TfdsAdapter
from gpupar.errors import GpuparError

# Asked in this order; the first whose takes(data) is true adapts the data.
FORMS = (TfdsAdapter, DatasetAdapter, DatasetFnAdapter, ArrayAdapter)


def adapter_for(data, role: str = "train_data") -> DataAdapter:
    """The adapter of `data` given as train_data or eval_data, with the checks that need no TensorFlow done.

    Raises:
      GpuparError: a form gpupar does not take, or data that its form refuses (arrays of
        different lengths, a batched dataset, a bad TFDS name).
    """
    if isinstance(data, DataAdapter):
        return data
    for form in FORMS:
        if form.takes(data):
            return form(data, role)
    raise GpuparError(f"{role} is a {type(data).__name__}; give (x, y) arrays, an unbatched tf.data.Dataset, a "
                      "dataset_fn(input_context), or a TFDS name such as 'tfds:mnist'")
