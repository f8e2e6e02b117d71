"""Real Keras programs that nobody here wrote (keras-io's examples, shrunk: tests/keras_io/), ported two ways.

By the two renames, as a script written to Keras' multi-GPU guide ports: the strategy's
constructor becomes gpupar.strategy(...), its `with strategy.scope():` build stays, and
model.fit( becomes gpupar.fit(model, ; nothing else changes. By the model_fn rule: the model's
build and compile move into model_fn, and model.fit( becomes gpupar.fit(model_fn, . Each runs
on 2 replicas beside Keras' own model.fit on one device; both must train and log the same names,
with finite numbers. A port that also offers script(strategy, fit, workdir) (the example's
program written to Keras' guide) is ported by the two renames in tests/test_keras_io_scripts.py,
which also holds it to Keras' names and accuracy: the same fit of the same model and data, so
not run twice.

The masked ports (an output mask from a layer's compute_mask or Embedding(mask_zero=True), or
SparseCategoricalCrossentropy(ignore_class=0)) are also held to Keras' numbers: the val_loss a fit
logs must be what Keras' own evaluate() on one device gives the weights that fit trained, a check
that no training noise enters, and gpupar's training loss must be Keras' one-device fit's within
the seed-to-seed spread.
"""

import functools
import importlib

import keras
import numpy as np
import pytest

import gpupar
import keras_io

# The ports with model_fn + train (one model, one fit); the others offer only script(strategy, fit, workdir),
# which tests/test_keras_io_scripts.py runs.
EXAMPLES = keras_io.ports("model_fn")
# The two-renames port of these is tests/test_keras_io_scripts.py's (the module docstring says why).
WITH_SCRIPT = set(keras_io.ports("script"))
SLOW = {"mobilenetv2_from_scratch", "image_classification_from_scratch",  # over 10 s each here
        "oxford_pets_image_segmentation", "bidirectional_lstm_imdb", "classification_with_grn_and_vsn"}


# The ports whose loss Keras averages over the real tokens only, not over the padding.
MASKED = ("neural_machine_translation_with_transformer",  # output mask (PositionalEmbedding) + ignore_class=0
          "ner_transformers",  # ignore_class=0, no mask
          "understanding_masking_and_padding")  # output mask (Embedding(mask_zero=True) -> LSTM -> Dense) alone
# gpupar.fit reduces these losses over every position, padding included (its own loss reduction ignores the
# loss's mask): its val_loss is Keras' times the real tokens' share. The fix of that makes these strict xfails
# pass (and fail as XPASS) and this set goes.
# Keras' own last training loss on one device spreads by 0.7% (the translator) and 0.2% (the tagger) over seeds
# 0-2: gpupar's must be within 5% of it. NER's spreads by 18% (its val_loss is held to evaluate() only).
TRAINING_LOSS_REL = {"neural_machine_translation_with_transformer": 0.05, "understanding_masking_and_padding": 0.05}


def _param(name):
    return pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])


@pytest.mark.parametrize("name", [_param(n) for n in EXAMPLES])
def test_a_keras_io_example_ports_by_the_rule(name, tmp_path):
    example = importlib.import_module(f"keras_io.{name}")
    for run in ("keras", "gpupar"):
        (tmp_path / run).mkdir()
    keras.utils.set_random_seed(0)
    theirs = example.train(example.model_fn().fit, str(tmp_path / "keras"))
    keras.utils.set_random_seed(0)
    ours = example.train(functools.partial(gpupar.fit, example.model_fn, strategy="mirrored", virtual_cpus=2,
                                           save=False), str(tmp_path / "gpupar"))
    assert ours.replicas == 2
    assert set(ours.history) == set(theirs.history), name  # the same logs, under Keras' names
    assert len(ours.epoch) == len(theirs.epoch)
    for log_name, values in ours.history.items():
        assert np.all(np.isfinite(values)), (name, log_name)


@pytest.mark.parametrize("name", [_param(n) for n in EXAMPLES if n not in WITH_SCRIPT])
def test_a_keras_io_example_ports_by_two_renames(name, tmp_path):
    example = importlib.import_module(f"keras_io.{name}")
    keras.utils.set_random_seed(0)
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)  # was: tf.distribute.MirroredStrategy([cpu:0, cpu:1])
    with strategy.scope():
        model = example.model_fn()
    result = example.train(functools.partial(gpupar.fit, model), str(tmp_path))  # was: model.fit
    assert result.replicas == 2 and result.model is model
    assert result.history and all(np.all(np.isfinite(values)) for values in result.history.values()), name


def test_at_least_ten_examples_are_ported():
    assert len(EXAMPLES) >= 10


def _capturing(fit, seen):
    """fit, recording the keyword arguments train() gives it (validation_data, batch_size) into seen."""
    def capturing_fit(*args, **kwargs):
        seen.update(kwargs)
        return fit(*args, **kwargs)
    return capturing_fit


def _fit_masked(name, runner, workdir):
    """(History or FitResult, trained model, fit keywords) of the port's train() with Keras' fit or gpupar.fit."""
    example = importlib.import_module(f"keras_io.{name}")
    seen = {}
    keras.utils.set_random_seed(0)
    if runner == "keras":
        model = example.model_fn()
        return example.train(_capturing(model.fit, seen), str(workdir)), model, seen
    options = dict(strategy="one_device") if runner == "gpupar-1" else dict(strategy="mirrored", virtual_cpus=2)
    result = example.train(_capturing(functools.partial(gpupar.fit, example.model_fn, save=False, **options), seen),
                           str(workdir))
    assert result.replicas == (1 if runner == "gpupar-1" else 2)
    return result, result.model, seen


def _evaluate_on_one_device(name, trained, seen):
    """Keras' own evaluate() of the trained weights on the fit's validation data: a model_fn model made outside any
    strategy, on one device."""
    model = importlib.import_module(f"keras_io.{name}").model_fn()
    data = seen["validation_data"]
    data, options = (data, dict(batch_size=seen.get("validation_batch_size") or seen.get("batch_size"))) \
        if isinstance(data, tuple) else ((data,), {})
    if not model.built:  # a subclassed model makes its weights on its first batch
        model.evaluate(*data, steps=1, verbose=0, **options)
    model.set_weights(trained.get_weights())
    return model.evaluate(*data, return_dict=True, verbose=0, **options)


_KERAS_FITS = {}  # name -> the History of Keras' one-device fit of the port in this process


@pytest.mark.parametrize("name,runner", [pytest.param(n, r, id=f"{n}-{r}") for n in MASKED
                                         for r in ("keras", "gpupar-1", "gpupar-2")])
def test_a_masked_keras_io_example_logs_the_val_loss_keras_evaluate_gives_its_weights(name, runner, tmp_path):
    """The last val_loss (and val metrics) a fit logs are Keras' evaluate() on one device of the weights it trained.

    Noise-free: the same weights, the same validation data, only the reduction differs. Keras' own fit (the control)
    logs exactly its evaluate(); gpupar.fit on 1 and 2 replicas must too, within round-off. Then, for the ports
    whose training loss is steady over seeds, gpupar's last training loss is held to Keras' one-device fit's.
    """
    history, trained, seen = _fit_masked(name, runner, tmp_path)
    if runner == "keras":
        _KERAS_FITS[name] = history
    evaluated = _evaluate_on_one_device(name, trained, seen)
    logged = {metric: history.history[f"val_{metric}"][-1] for metric in evaluated}
    assert logged == pytest.approx(evaluated, rel=1e-4), (name, runner, "logged", logged, "evaluate()", evaluated)
    if runner != "keras" and name in TRAINING_LOSS_REL:
        if name not in _KERAS_FITS:
            _KERAS_FITS[name] = _fit_masked(name, "keras", tmp_path / "keras")[0]
        ours, theirs = history.history["loss"][-1], _KERAS_FITS[name].history["loss"][-1]
        assert ours == pytest.approx(theirs, rel=TRAINING_LOSS_REL[name]), (name, runner, "loss", ours, "Keras", theirs)


def test_the_masked_examples_are_ports():
    assert set(MASKED) <= set(EXAMPLES) and set(TRAINING_LOSS_REL) <= set(MASKED)


def test_the_ner_port_compiles_keras_ignore_class_loss_for_the_examples_own(tmp_path):
    """ner_transformers compiles SparseCategoricalCrossentropy(ignore_class=0) where keras-io compiles its
    CustomNonPaddingTokenLoss: on one device the two give the same loss on the same weights and data."""
    from keras_io import ner_transformers as ner
    keras.utils.set_random_seed(0)
    _, val_dataset = ner._datasets(str(tmp_path))
    model = ner.model_fn()
    ports = model.evaluate(val_dataset, return_dict=True, verbose=0)["loss"]
    model.compile(optimizer="adam", loss=ner.CustomNonPaddingTokenLoss())
    examples = model.evaluate(val_dataset, return_dict=True, verbose=0)["loss"]
    assert ports == pytest.approx(examples, rel=1e-6)
    assert ports == pytest.approx(np.log(ner.num_tags), rel=0.2)  # an untrained model: the real tokens, not the zeros
