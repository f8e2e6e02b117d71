"""In-memory arrays (NumPy, pandas, Python lists, tensors, ragged tensors) through gpupar's seeded pipeline: exact resume."""

import numpy as np
import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.data.adapters.adapter import DataAdapter
from gpupar.errors import GpuparError

PARTS = ("x", "y", "sample_weight")


class ArrayAdapter(DataAdapter):
    """x, y and sample_weight in memory, each an array or a dict, list or tuple of arrays, one row per example.

    As model.fit takes them: a pandas DataFrame or Series is its values, a dict of them named
    inputs, a list or tuple of arrays several inputs (or outputs), and a Python list of numbers or
    strings one array. Each pass is a fresh permutation from (seed, pass) (shuffle=False keeps the
    order), so a run resumed mid-epoch trains on exactly the batches it would have seen.
    """

    resume_note = None

    def __init__(self, x, y=None, sample_weight=None, class_weight=None, role: str = "x"):
        super().__init__(x, role)
        self.form = "arrays"
        parts = [to_arrays(x)] + [to_arrays(part) for part in (y, sample_weight) if part is not None]
        if sample_weight is not None and y is None:
            raise GpuparError(f"{role}: sample_weight without y; give the labels too")
        if class_weight is not None:
            if sample_weight is not None:
                raise GpuparError("class_weight and sample_weight both weigh the examples; give one of them (or fold "
                                  "the class weights into sample_weight)")
            parts.append(class_weights(parts[1] if y is not None else None, class_weight))
        self.class_weighted = class_weight is not None
        self.arrays, self.num_examples = checked_arrays(tuple(parts), role)
        self.description = f"arrays of {self.num_examples} examples"

    @classmethod
    def takes(cls, data) -> bool:
        return is_array_like(data)

    def sample(self, count: int = 4):
        batch = tf.nest.map_structure(lambda a: a[:count], self.arrays)
        return tf.nest.map_structure(lambda a: a if isinstance(a, tf.RaggedTensor) else np.asarray(a), batch)

    def labels(self):
        return self.arrays[1] if len(self.arrays) > 1 else None

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1) -> int:
        return array_pipeline.batches_per_epoch(self.num_examples, global_batch)

    def batches(self, global_batch: int, first_step: int = 0, limit=None):
        options = self.options
        dataset = array_pipeline.train_dataset(
            self.arrays, global_batch, self.seed, start_step=first_step, num_parallel_calls=options.num_parallel_calls if options else None,
            deterministic=options.deterministic if options else True, threads=options.data_threads if options else None,
            shuffle=options.shuffle if options else True)
        return self._as_keras_packs(dataset if limit is None else dataset.take(limit))

    def one_pass(self, global_batch: int):
        return (self._as_keras_packs(array_pipeline.eval_dataset(self.arrays, global_batch)),
                array_pipeline.test_steps(self.num_examples, global_batch))

    def _as_keras_packs(self, dataset):
        """Batches of x alone as x, not (x,), where x is no tuple: what Keras gives a model's own train_step."""
        if len(self.arrays) == 1 and not isinstance(self.arrays[0], (tuple, list)):
            return dataset.map(lambda x: x)
        return dataset

    def split(self, validation_split: float):
        """(the first examples, the last `validation_split` of them), as Keras' fit splits them before shuffling."""
        at = int(np.floor(self.num_examples * (1.0 - validation_split)))
        if at in (0, self.num_examples):
            raise GpuparError(f"validation_split={validation_split} leaves {at} of {self.num_examples} examples for "
                              "training; choose a fraction that leaves some for each")
        train, validation = (_copy(self, tf.nest.map_structure(lambda a: a[part], self.arrays))
                             for part in (slice(None, at), slice(at, None)))
        validation.role = "validation_data"
        if self.class_weighted:  # as in Keras, class weights weigh the training examples only
            validation.arrays = validation.arrays[:2]
        return train, validation


def _copy(adapter, arrays):
    """The adapter with other arrays."""
    copy = object.__new__(type(adapter))
    copy.__dict__.update(adapter.__dict__)
    copy.arrays, copy.num_examples = arrays, array_pipeline.rows(tf.nest.flatten(arrays)[0])
    copy.description = f"arrays of {copy.num_examples} examples"
    return copy


def _is_pandas(value) -> bool:
    return type(value).__module__.startswith("pandas") and hasattr(value, "to_numpy")


def _is_leaf(value) -> bool:
    return isinstance(value, (np.ndarray, tf.Tensor, tf.RaggedTensor)) or _is_pandas(value)


def _scalar(value) -> bool:
    return isinstance(value, (int, float, str, bytes, bool, np.generic))


def _numbers(data) -> bool:
    """Whether a list holds numbers or strings (or lists of them): one array, not a structure of arrays."""
    return bool(data) and all(_scalar(v) or isinstance(v, (list, tuple)) and all(map(_scalar, v)) for v in data)


def is_array_like(data) -> bool:
    """Whether `data` is x (or y) of arrays: an array, a DataFrame, a list of numbers, or a structure of those."""
    if _is_leaf(data):
        return True
    if isinstance(data, dict):
        return bool(data) and all(is_array_like(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return _numbers(data) or bool(data) and all(is_array_like(v) for v in data)
    return False


def to_arrays(data):
    """x (or y, sample_weight) as NumPy arrays (ragged tensors kept): pandas' values, a list of numbers as one array."""
    if _is_pandas(data):
        return data.to_numpy()
    if isinstance(data, tf.RaggedTensor):
        return data
    if isinstance(data, dict):
        return {k: to_arrays(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)) and not _numbers(data):
        return tuple(to_arrays(v) for v in data)
    return np.asarray(data)


def class_weights(y, class_weight):
    """Each example's weight, class_weight[its class], as Keras' fit turns class_weight into sample weights.

    The class of a label is the label (shape (N,) or (N, 1)), or its argmax for one-hot labels; a
    class the dict does not name weighs 1.0, as in Keras.

    Raises:
      GpuparError: no labels, or several outputs.
    """
    if y is None:
        raise GpuparError("class_weight weighs the examples by their labels' classes, and there is no y")
    if isinstance(y, (dict, tuple, list)):
        raise GpuparError("class_weight is only supported for models with a single output (as in Keras); give "
                          "sample_weight per output instead")
    if not isinstance(class_weight, dict):
        raise GpuparError(f"class_weight is a {type(class_weight).__name__}; give a dict {{class: weight}}")
    labels = np.asarray(y)
    classes = np.argmax(labels, axis=-1) if labels.ndim > 1 and labels.shape[-1] > 1 else np.round(
        labels.reshape(len(labels))).astype(np.int64)
    return np.array([class_weight.get(c, 1.0) for c in classes.tolist()], np.float32)


def checked_arrays(data, what: str):
    """Checks an (x[, y[, sample_weight]]) tuple of arrays; returns (the structure, examples)."""
    lengths = {}
    for part, name in zip(data, PARTS):
        for leaf in tf.nest.flatten(part):
            if not isinstance(leaf, tf.RaggedTensor) and np.ndim(leaf) == 0:
                raise GpuparError(f"{what}: {name} holds a scalar; give one row per example")
            lengths.setdefault(name, set()).add(array_pipeline.rows(leaf))
    sizes = {n for s in lengths.values() for n in s}
    if len(sizes) != 1:
        shown = ", ".join(f"{name} {'/'.join(map(str, sorted(s)))}" for name, s in lengths.items())
        raise GpuparError(f"{what}: the arrays have different numbers of examples ({shown}); give every part one row "
                          "per example")
    count = sizes.pop()
    if count == 0:
        raise GpuparError(f"{what} is empty")
    return data, count
