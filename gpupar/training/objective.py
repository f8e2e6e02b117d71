"""What training minimises and reports: the loss over the GLOBAL batch, and Keras metrics combined over replicas.

Loss: whatever is given (a Keras name, a keras.losses.Loss, or a function(y_true, y_pred) of one
value per example) is resolved as Keras' compile resolves it: a name or a function becomes a
keras.losses.LossFunctionWrapper, whose call brings labels of shape (N,) and outputs of shape
(N, 1) to the same rank. gpupar takes the per-example values and reduces them as the loss's own
reduction says, over all replicas at once, each output's times its loss_weight: each replica divides its weighted sum by the global
denominator (the number of values for "sum_over_batch_size" and "mean", the sum of the sample
weights for "mean_with_sample_weight"), one scalar all-reduce per step, so the replicas' sum is
the loss of the whole global batch, a last partial batch included. A Keras loss object's own
`__call__` is not used: inside a strategy it divides by the replica count a second time.

Metrics: each replica computes its metrics' state for its share of the batch from zero
(`Metric.stateless_update_state`); the states are sums (totals, counts, confusion matrices), so
they are summed over replicas, steps and workers on the devices, and the host adds them to the
metric's own variables once per call to read its result. A metric whose state does not add up
over batches is refused before training.
"""

import dataclasses
from typing import Any, Callable, List, Optional

import keras
import numpy as np
import tensorflow as tf
# Keras' own resolution of loss and metric names (the one its compile uses), so that every name
# means what it means in Keras: "crossentropy" and "accuracy" by the labels' and outputs' shapes.
from keras.src.trainers.compile_utils import get_loss, get_metric

from gpupar.errors import GpuparError

SUM = tf.distribute.ReduceOp.SUM
REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")


@dataclasses.dataclass
class LossTerm:
    """The loss of one model output: its per-example function and its reduction."""

    key: Any  # the output's name or index; None for a model with one output
    fn: Callable
    reduction: str
    name: str
    sparse: bool = False  # sparse categorical cross-entropy: integer labels that must index the outputs
    weight: float = 1.0  # the output's loss_weight


@dataclasses.dataclass
class MetricTerm:
    """One Keras metric on one output, under the name the logs give it; only weighted ones see sample weights."""

    key: Any
    metric: Any
    name: str
    weighted: bool = False
    loss: Optional[LossTerm] = None  # a multi-output model's per-output loss, logged as Keras logs it


def _label_keys(y, keys, with_loss):
    """The outputs that y's labels go to, in order, where y holds fewer labels than the model has outputs; else None.

    As Keras' compile: a model with outputs whose loss is None takes one label per output that has
    a loss (loss=[fn, None] with one y: y is the first output's labels).
    """
    if y is None or len(keys) < 2 or isinstance(y, dict):
        return None
    labels = list(y) if isinstance(y, (list, tuple)) else [y]
    return list(with_loss) if len(labels) != len(keys) and len(labels) == len(with_loss) else None


def _part(structure, key):
    return structure if key is None else structure[key]


def _output_keys(y_pred) -> list:
    if isinstance(y_pred, dict):
        return sorted(y_pred)
    if isinstance(y_pred, (list, tuple)):
        return list(range(len(y_pred)))
    return [None]


def _loss_term(spec, key, where, y_true, y_pred, weight=1.0) -> LossTerm:
    """The LossTerm of one loss given as a Keras name, a keras.losses.Loss (or its class), or a function."""
    if isinstance(spec, type) and issubclass(spec, keras.losses.Loss):
        spec = spec()
    if not isinstance(spec, (str, keras.losses.Loss)) and not callable(spec):
        raise GpuparError(f"loss{where} is a {type(spec).__name__}; give a Keras loss name, a keras.losses.Loss or a "
                          "function(y_true, y_pred)")
    try:
        loss = get_loss(spec, y_true, y_pred)
    except ValueError:
        raise GpuparError(f"loss{where}: unknown Keras loss name; use one such as 'sparse_categorical_crossentropy', "
                          "'categorical_crossentropy', 'mse', or pass a keras.losses.Loss or a function(y_true, "
                          "y_pred)") from None
    # Keras' loss objects keep their function as .fn; the name can be the user's own.
    sparse = getattr(loss, "fn", loss) is keras.losses.sparse_categorical_crossentropy
    if loss.reduction not in REDUCTIONS:
        raise GpuparError(f"loss{where}: reduction={loss.reduction!r} leaves the loss unreduced; gpupar averages it over "
                          f"the global batch as the reduction says: use one of {', '.join(REDUCTIONS)}")
    return LossTerm(key, loss.call, loss.reduction, loss.name, sparse, float(weight))


def _metric(spec, y_true, y_pred, where):
    """A fresh Keras metric object for `spec` (a name, a Metric, or a function), as Keras' compile resolves it."""
    if isinstance(spec, type) and issubclass(spec, keras.metrics.Metric):
        return spec()
    if isinstance(spec, keras.metrics.Metric):
        return spec.__class__.from_config(spec.get_config())  # a fresh one, with variables on the host
    if not isinstance(spec, str) and not callable(spec):
        raise GpuparError(f"metrics{where}: {spec!r} is not a metric; give Keras metric names or keras.metrics.Metric "
                          "objects")
    try:
        return get_metric(spec, y_true, y_pred)
    except ValueError:
        raise GpuparError(f"metrics{where}: {spec!r} is not a Keras metric name; use one such as 'accuracy', 'mae', "
                          "'auc', or pass a keras.metrics.Metric") from None


def _by_output(spec, keys, what):
    """{output key: its spec}: one spec for every output, or a dict or list matching the outputs."""
    if isinstance(spec, dict) and not isinstance(spec, str):
        unknown = set(spec) - set(keys)
        if unknown:
            raise GpuparError(f"{what} names output(s) {sorted(unknown)} that the model does not have (its outputs: "
                              f"{keys})")
        return dict(spec)
    # A list of one entry per output: for the loss any list, for the metrics a list of lists.
    per_output = what in ("loss", "loss_weights") or all(item is None or isinstance(item, (list, tuple)) for item in spec or (0,))
    if isinstance(spec, (list, tuple)) and len(keys) > 1 and per_output:
        if len(spec) != len(keys):
            raise GpuparError(f"{what} is a list of {len(spec)} but the model has {len(keys)} outputs")
        return dict(zip(keys, spec))
    return {key: spec for key in keys}


class Objective:
    """The loss and the metrics of a run, built for the model's outputs from one sample batch.

    Attributes:
      losses: One LossTerm per output with a loss.
      metrics: One MetricTerm per output and metric.
    """

    def __init__(self, loss, metrics, sample_y, sample_y_pred, output_names=None, loss_weights=None,
                 weighted_metrics=None, model_losses=False):
        """Args: the loss, metrics, loss_weights and weighted_metrics as compile takes them; one batch of
        labels (None for a model trained on x alone) and of the model's outputs; the model's output
        names, which name the metrics of a list of outputs as Keras does; and whether the model adds
        losses of its own (add_loss, regularisers), which may then be its whole loss."""
        keys = _output_keys(sample_y_pred)
        losses = {} if loss is None else _by_output(loss, keys, "loss")
        weights = {} if loss_weights is None else _by_output(loss_weights, keys, "loss_weights")
        self.label_keys = _label_keys(sample_y, keys, [key for key, spec in losses.items() if spec is not None])
        sample_y = self.labels(sample_y)
        if any(spec is not None for spec in losses.values()) and sample_y is None:
            raise GpuparError("the loss needs labels, but there is no y: pass y (gpupar.fit(model_fn, x, y, ...); as in "
                              "Keras a tuple x is the model's inputs), or train on x alone with a loss the model adds")
        self.losses = [_loss_term(spec, key, f"[{key!r}]" if key is not None else "", _part(sample_y, key),
                                  _part(sample_y_pred, key), weights.get(key, 1.0))
                       for key, spec in losses.items() if spec is not None]
        if sample_y is None and (metrics or weighted_metrics):
            raise GpuparError("the metrics need labels, but there is no y: pass y, or no metrics")
        if not self.losses and not model_losses:
            raise GpuparError("the model has no loss: compile it with one in model_fn (model.compile(loss=...)) or pass "
                              "loss=..., or add one in the model (self.add_loss)")
        self.metrics: List[MetricTerm] = []
        if len(self.losses) > 1:  # as Keras' compile: each output's loss, unweighted, under "<output>_loss"
            for term in self.losses:
                name = self._log_name("loss", term.key, output_names, False)
                self.metrics.append(MetricTerm(term.key, keras.metrics.Mean(name=name), name, loss=term))
        for weighted, given in ((False, metrics), (True, weighted_metrics)):
            what = "weighted_metrics" if weighted else "metrics"
            for key, specs in _by_output(given or (), keys, what).items():
                for spec in ([specs] if isinstance(specs, (str, keras.metrics.Metric)) or callable(specs)
                             else specs or ()):
                    where = f"[{key!r}]" if key is not None else ""
                    metric = _metric(spec, _part(sample_y, key), _part(sample_y_pred, key), where)
                    self.metrics.append(MetricTerm(key, metric, self._log_name(metric.name, key, output_names,
                                                                               weighted), weighted))
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names) or "loss" in names:
            raise GpuparError(f"metrics: two metrics would log under the same name ({', '.join(names)}); give them "
                              "names of their own (name=...)")

    def labels(self, y):
        """y as the outputs' losses and metrics read it: by output, where fewer labels than outputs came (label_keys)."""
        if self.label_keys is None or y is None:
            return y
        return dict(zip(self.label_keys, y if isinstance(y, (list, tuple)) else [y]))

    def _log_name(self, name, key, output_names, weighted):
        """The metric's log name as Keras' compile gives it: '<output>_<name>', 'weighted_<name>' where taken."""
        output = key if not isinstance(key, int) or not output_names else output_names[key]
        prefix = "" if key is None else f"{output}_"
        if weighted and f"{prefix}{name}" in [m.name for m in self.metrics]:
            return f"{prefix}weighted_{name}"
        return f"{prefix}{name}"

    @property
    def names(self) -> List[str]:
        """The metrics' log names, in order."""
        return [m.name for m in self.metrics]

    def zero_states(self) -> list:
        """Zeros shaped like every metric's variables, flattened in order."""
        return [np.zeros(v.shape, np.float32) for m in self.metrics for v in m.metric.variables]

    def terms(self, y, y_pred, sample_weight):
        """(weighted sums, local denominators) of this replica's share: one of each per loss, as tensors.

        Each sum is times its output's loss_weight. As Keras' Loss.__call__ does, labels and outputs
        reach the loss's call as float32.
        """
        if not self.losses:  # the model's own losses (add_loss) are the whole loss
            return tf.zeros([0]), tf.zeros([0])
        y = self.labels(y)
        parts = [_term_sums(term, y, y_pred, sample_weight) for term in self.losses]
        return (tf.stack([numerator * term.weight for term, (numerator, _) in zip(self.losses, parts)]),
                tf.stack([denominator for _, denominator in parts]))

    def added_denominators(self, parts):
        """The denominators of a batch from those of its parts (terms() of each, outside a strategy).

        Counts and sums of weights add up; "sum" is one per batch whatever its parts.
        """
        total = tf.add_n(list(parts))
        if not self.losses:
            return total
        return tf.stack([tf.ones_like(d) if term.reduction == "sum" else d
                         for term, d in zip(self.losses, tf.unstack(total))])

    def replica_loss(self, y, y_pred, sample_weight, whole=None, total=None):
        """This replica's share of the loss of the global batch, and the global denominators.

        The replicas' shares sum to the loss of the global batch. For gradient accumulation the
        batch is one micro-batch of a whole one: `whole`, (rows, sample weights) of this replica's
        whole batch, makes the denominators the whole global batch's; `total` gives them, as
        returned for an earlier micro-batch. The micro-batches' shares then sum to the whole
        batch's loss. Returns (loss share, denominators over all replicas).
        """
        numerators, denominators = self.terms(y, y_pred, sample_weight)
        if total is None:
            if whole is not None:
                denominators = self._whole_denominators(denominators, len_rows(y_pred), *whole)
            total = summed_over_replicas(denominators)
        return tf.reduce_sum(tf.math.divide_no_nan(numerators, total)), total

    def _whole_denominators(self, denominators, rows, whole_rows, whole_weight):
        """The denominators of a whole batch, from those of its first `rows` rows.

        Every row of a batch has the same number of loss values, so a count scales with the rows;
        a sum of sample weights is taken over the whole batch's; "sum" stays one per global batch.
        """
        if not self.losses:
            return denominators
        scaled = []
        for term, denominator in zip(self.losses, tf.unstack(denominators)):
            weight = _part(whole_weight, term.key) if isinstance(whole_weight, dict) else whole_weight
            if term.reduction == "mean_with_sample_weight" and weight is not None:
                scaled.append(tf.reduce_sum(tf.cast(weight, tf.float32)))
            elif term.reduction == "sum":
                scaled.append(denominator)
            else:
                scaled.append(denominator * tf.cast(whole_rows, tf.float32) / tf.cast(rows, tf.float32))
        return tf.stack(scaled)

    def metric_states(self, y, y_pred, sample_weight) -> list:
        """The metrics' states for this share of the batch alone, flattened (they add up over shares)."""
        y, states = self.labels(y), []
        for term in self.metrics:
            if term.loss is not None:
                states += self._loss_state(term.loss, y, y_pred, sample_weight)
                continue
            weight = None  # as in Keras, sample weights reach the weighted metrics only
            if term.weighted:
                weight = _part(sample_weight, term.key) if isinstance(sample_weight, dict) else sample_weight
            zeros = [tf.zeros(v.shape, v.dtype) for v in term.metric.variables]
            updated = term.metric.stateless_update_state(zeros, _part(y, term.key), _part(y_pred, term.key),
                                                         sample_weight=weight)
            states += [tf.cast(s, tf.float32) for s in updated]
        return states

    def _loss_state(self, term: LossTerm, y, y_pred, sample_weight) -> list:
        """A Mean's (total, count) of one output's loss on this share: its mean here, weighed by the share's rows.

        As Keras' per-output loss trackers, which take each batch's value with the batch's size as weight.
        """
        numerator, denominator = _term_sums(term, y, y_pred, sample_weight)
        rows = tf.cast(len_rows(_part(y_pred, term.key)), tf.float32)
        return [tf.math.divide_no_nan(numerator, denominator) * rows, rows]

    def results(self, states) -> dict:
        """{log name: value} of the metrics whose summed states are `states` (host arrays)."""
        logs, i = {}, 0
        for term in self.metrics:
            variables = term.metric.variables
            for variable, value in zip(variables, states[i:i + len(variables)]):
                variable.assign(np.asarray(value, dtype=variable.dtype))
            i += len(variables)
            value = np.asarray(term.metric.result())  # a vector for some (Precision at several thresholds)
            logs[term.name] = float(value) if value.ndim == 0 else value.tolist()
        return logs

    def batch_level(self, y, y_pred) -> List[str]:
        """The names of the losses that give one value for a whole batch rather than one per example."""
        y = self.labels(y)
        return [term.name for term in self.losses
                if tf.rank(term.fn(tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), _part(y, term.key)),
                                   tf.cast(_part(y_pred, term.key), tf.float32))) == 0]

    def check_additive(self, y, y_pred, sample_weight):
        """Refuses a metric whose state on a batch is not the sum of its states on the batch's halves."""
        if not self.metrics:
            return
        size = len(tf.nest.flatten(y)[0])
        if size < 2:
            return
        half = size // 2

        def piece(structure, part):
            return tf.nest.map_structure(lambda a: a[part], structure) if structure is not None else None

        whole = self.results([np.asarray(s) for s in self.metric_states(y, y_pred, sample_weight)])
        halves = [self.metric_states(piece(y, p), piece(y_pred, p), piece(sample_weight, p))
                  for p in (slice(None, half), slice(half, None))]
        added = self.results([np.asarray(a) + np.asarray(b) for a, b in zip(*halves)])
        for name in whole:
            if not np.allclose(whole[name], added[name], rtol=1e-4, atol=1e-6):
                raise GpuparError(f"metric {name!r}: its state on a batch is not the sum of its states on the batch's "
                                  "halves, and gpupar combines replicas and steps by adding states; use a metric whose "
                                  "variables are totals and counts")

    def reset(self):
        """Puts every metric's variables back to zero."""
        for term in self.metrics:
            term.metric.reset_state()


def _term_sums(term: LossTerm, y, y_pred, sample_weight):
    """(the weighted sum of one loss's values on this share, its local denominator as the reduction says)."""
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else 1
    labels = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), _part(y, term.key))
    outputs = tf.cast(_part(y_pred, term.key), tf.float32)
    values = tf.cast(term.fn(labels, outputs), tf.float32)
    if values.shape.rank == 0:  # one value for the batch (dice, tversky): each example gets it, as in Keras
        values = tf.broadcast_to(values, [len_rows(outputs)])
    weight = _part(sample_weight, term.key) if isinstance(sample_weight, dict) else sample_weight
    if weight is not None:
        weight = tf.cast(weight, tf.float32)
        while weight.shape.rank < values.shape.rank:
            weight = weight[..., tf.newaxis]
        while weight.shape.rank > values.shape.rank:
            weight = tf.squeeze(weight, -1)
    numerator = tf.reduce_sum(values if weight is None else values * weight)
    if term.reduction == "mean_with_sample_weight" and weight is not None:
        return numerator, tf.reduce_sum(weight)
    if term.reduction == "sum":
        return numerator, tf.constant(1.0 / replicas)  # one per global batch
    return numerator, tf.cast(tf.size(values), tf.float32)


def summed_over_replicas(value):
    """value summed over the replicas in sync (itself where there is one: a parameter-server worker, one device)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(SUM, value)


def len_rows(structure):
    """The rows (examples) of a batch: the first dimension of its first tensor."""
    return tf.shape(tf.nest.flatten(structure)[0])[0]
