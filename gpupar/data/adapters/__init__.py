"""The input forms gpupar takes, one adapter class each, behind one `adapter_for(x, y, ...)`.

As model.fit takes them: NumPy arrays, pandas DataFrames and Series, Python lists and ragged
tensors (arrays), a tf.data.Dataset batched or not, a keras.utils.PyDataset, a generator or a
generator function; and gpupar's own: a dataset_fn(input_context) of per-replica batches and a
TFDS name. Adding a form is one module with a DataAdapter subclass and one entry in FORMS.
"""

from gpupar.data.adapters.adapter import DataAdapter
from gpupar.data.adapters.arrays import ArrayAdapter
from gpupar.data.adapters.dataset import DatasetAdapter
from gpupar.data.adapters.dataset_fn import DatasetFnAdapter
from gpupar.data.adapters.generator import GeneratorAdapter
from gpupar.data.adapters.py_dataset import PyDatasetAdapter
from gpupar.data.adapters.python_batches import input_errors
from gpupar.data.adapters.tfds_name import TfdsAdapter
from gpupar.errors import GpuparError

# Asked in this order; the first whose takes(x) is true adapts the data. A generator function is
# asked before a dataset_fn, which is any other function.
FORMS = (ArrayAdapter, TfdsAdapter, DatasetAdapter, PyDatasetAdapter, GeneratorAdapter, DatasetFnAdapter)
TRAINING, VALIDATION = "x", "validation_data"

__all__ = ["DataAdapter", "FORMS", "adapter_for", "fit_data", "input_errors"]


def adapter_for(x, y=None, sample_weight=None, class_weight=None, role: str = TRAINING) -> DataAdapter:
    """The adapter of the data given as x (with y, sample_weight, class_weight), the checks that need no TensorFlow done.

    Raises:
      GpuparError: a form gpupar does not take, or data that its form refuses (arrays of
        different lengths, y with a dataset, a bad TFDS name).
    """
    if isinstance(x, DataAdapter):
        return x
    if x is None:
        raise GpuparError(f"{role} is None; give the training data, e.g. gpupar.fit(model_fn, x, y, ...)")
    for form in FORMS:
        if form.takes(x):
            if form is ArrayAdapter:
                return ArrayAdapter(x, y, sample_weight, class_weight, role)
            if form is DatasetFnAdapter and class_weight is not None:
                raise GpuparError(f"class_weight is not available with {role} as a dataset_fn; give sample weights in "
                                  "its batches")
            adapter = form(x, role) if form is DatasetFnAdapter else form(x, role, class_weight)
            for name, given in (("y", y), ("sample_weight", sample_weight)):
                if given is not None:
                    raise GpuparError(f"{name} is given, but {role} is {adapter.form}, whose elements hold it (as in "
                                      "Keras): give it inside the data")
            return adapter
    raise GpuparError(f"{role} is a {type(x).__name__}; give arrays (NumPy, pandas, lists), a tf.data.Dataset, a "
                      "keras.utils.PyDataset, a generator, a dataset_fn(input_context), or a TFDS name such as "
                      "'tfds:mnist'")


def fit_data(x, y=None, sample_weight=None, class_weight=None, validation_split=0.0, validation_data=None):
    """(the training adapter, the validation adapter or None) of model.fit's data arguments, as Keras reads them.

    validation_data is (x, y) or (x, y, sample_weight), or any form of x; validation_split takes
    the last fraction of the arrays, before shuffling, as Keras' fit does (arrays only).

    Raises:
      GpuparError: as adapter_for; validation_split with data that are not arrays, or with validation_data.
    """
    train = adapter_for(x, y, sample_weight, class_weight)
    if validation_split:
        if not 0 < validation_split < 1:
            raise GpuparError(f"validation_split={validation_split}: give a fraction in (0, 1)")
        if validation_data is not None:
            raise GpuparError("validation_split and validation_data both give the evaluation set; give one of them")
        if not isinstance(train, ArrayAdapter):
            raise GpuparError(f"validation_split takes the last examples of arrays, and x is {train.form} (as in Keras); "
                              "pass validation_data instead")
        return train.split(validation_split)
    if validation_data is None:
        return train, None
    if isinstance(validation_data, (tuple, list)) and 2 <= len(validation_data) <= 3:
        return train, adapter_for(*validation_data, role=VALIDATION)
    return train, adapter_for(validation_data, role=VALIDATION)
