"""Config: one validated object, in parts, for the API, the flags and the tests; the MNIST presets' options beside it."""

import dataclasses

import pytest

from gpupar.config import PARTS, Config, field_help, field_names
from gpupar.errors import GpuparError
from gpupar.presets.mnist import refuse_for_mode
from gpupar.presets.mnist_options import MnistOptions, mnist_options
from gpupar.training import modes


def test_defaults_match_the_documented_api():
    c, preset = Config(), MnistOptions()
    assert (c.loop.epochs, c.input.batch_size, c.loop.verbose, c.loop.display_step) == (1, None, "auto", None)  # fit's
    assert (c.step_options.learning_rate, c.distribution.strategy, preset.dataset) == (1e-3, "auto", "mnist")
    config, _ = mnist_options()  # the presets' own
    assert (config.loop.epochs, config.input.per_replica_batch_size, config.loop.display_step, config.loop.verbose) == (
        5, 1024, 10, 2)


def test_every_field_has_help():
    helps = field_help()
    assert set(helps) == set(field_names())
    assert all(helps.values())
    assert set(MnistOptions.field_help()) == set(MnistOptions.field_names()) and all(MnistOptions.field_help().values())


def test_every_option_belongs_to_one_part():
    names = [name for _, part in PARTS for name in part.field_names()] + MnistOptions.field_names()
    assert len(names) == len(set(names))  # flat option names say which part they set


def test_config_and_its_parts_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().loop = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().loop.epochs = 3


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(epochs=-1), "epochs=-1"),
        (dict(batch_size=0), "batch_size=0"),
        (dict(batch_size=2.5), "batch_size=2.5"),
        (dict(learning_rate=0), "learning_rate=0"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(strategy="towers"), "choose one of: auto, one_device, mirrored, central_storage"),
        (dict(cross_device_ops="mpi"), "cross_device_ops='mpi' is unknown"),
        (dict(dataset="cifar10"), "dataset='cifar10' is unknown; choose one of: mnist, fashion_mnist"),
        (dict(data_dir="/no/such/folder"), "data_dir='/no/such/folder' does not exist"),
        (dict(memory_fraction=1.5), "memory_fraction=1.5"),
        (dict(augment_on="gpu"), "augment_on='gpu' is unknown; choose one of: device, host"),
        (dict(augment="yes"), "augment='yes': must be True or False"),
        (dict(num_parallel_calls=0), "num_parallel_calls=0: must be a whole number > 0"),
        (dict(data_threads=-2), "data_threads=-2: must be a whole number > 0"),
        (dict(profile_steps="20"), "give the first and last step to profile"),
        (dict(profile_steps="a,b", log_dir="/tmp"), "not two whole numbers"),
        (dict(profile_steps="40,20", log_dir="/tmp"), "need 1 <= first <= last"),
        (dict(profile_steps="0,20", log_dir="/tmp"), "need 1 <= first <= last"),
        (dict(profile_steps="20,40", save=False), "profile_steps needs log_dir"),
        (dict(strategy="model_parallel", augment=True), "augment is not available with strategy=model_parallel"),
        (dict(strategy="parameter_server", augment=True), "augment is not available with strategy=parameter_server"),
        (dict(strategy="parameter_server", sync_batch_norm=True),
         "sync_batch_norm synchronises replicas that step together; strategy=parameter_server updates asynchronously"),
        (dict(memory_fraction=0.5, memory_limit_mb=1000), "give only one of them"),
        (dict(gpus="0,x"), "'x' is not a GPU index"),
        (dict(gpus="1,1"), "names a GPU twice"),
        (dict(devices="gpu0"), "'gpu0' is not a device name"),
        (dict(save="no"), "save='no': must be True or False"),
        (dict(resume="/no/ckpt-3"), "no checkpoint there"),
        (dict(virtual_cpus=0), "virtual_cpus=0"),
        (dict(checkpoint_every_steps=10, save=False), "checkpoint_every_steps saves checkpoints within an epoch, and "
         "save=False writes none"),
        (dict(checkpoint_every_steps=0), "checkpoint_every_steps=0: must be a whole number > 0"),
        (dict(max_to_keep=0), "max_to_keep=0: must be a whole number > 0"),
        (dict(nan_policy="ignore"), "nan_policy='ignore' is unknown; choose one of: stop, skip"),
        (dict(gpus=1.5), "give GPU indices as"),
        (dict(devices=3), "give device names as"),
        (dict(metrics_json="/proc/version/m.json"), "metrics_json='/proc/version/m.json' cannot be written"),
        (dict(log_dir="/proc/version/tb"), "log_dir='/proc/version/tb' cannot be written"),
        (dict(memory_growth="yes"), "memory_growth='yes'"),
        (dict(steps_per_call=0), "steps_per_call=0: must be a whole number >= 1, or auto"),
        (dict(precision="float16"), "precision='float16' is unknown; choose one of: float32, mixed_bfloat16"),
        (dict(precision="mixed_float16", nan_policy="skip"), "use it with nan_policy=stop"),
        (dict(strategy="model_parallel", jit_compile=True), "precision and jit_compile are not available with"),
        (dict(strategy="parameter_server", precision="mixed_bfloat16"), "not available with strategy=parameter_server"),
        (dict(jit_compile=1), "jit_compile=1: must be True or False"),
        (dict(intra_op_threads=-1), "intra_op_threads=-1: must be a whole number >= 0 (0 leaves it to TensorFlow)"),
        (dict(stop_at_accuracy=1.5), "stop_at_accuracy=1.5: must be an accuracy in (0, 1]"),
        (dict(accumulate_steps=0), "accumulate_steps=0: must be a whole number > 0"),
        (dict(accumulate_steps=2.5), "accumulate_steps=2.5: must be a whole number > 0"),
        (dict(strategy="model_parallel", stages=2.5), "stages=2.5: name the layers after which a new stage starts"),
        (dict(strategy="model_parallel", stages=["a", True]), "True is not a layer name or index"),
        (dict(strategy="model_parallel", stages="a,,b"), "'' is not a layer name or index"),
        (dict(ps_shards=0), "ps_shards=0: must be a whole number > 0"),
        (dict(ps_shards="2"), "ps_shards='2': must be a whole number > 0"),
    ],
)
def test_bad_values_are_one_clear_error(options, message):
    """Each part checks its values, the Config its parts together, the mode what it cannot run: all before TensorFlow."""
    with pytest.raises(GpuparError, match=None) as e:
        config, preset = mnist_options(options=options)
        refuse_for_mode(preset, modes.checked(config))
    assert message in str(e.value)


def test_steps_per_call_defaults_to_display_step_capped_at_the_epoch():
    assert Config(display_step=10).loop.steps_in_a_call(58) == 10
    assert Config(display_step=100).loop.steps_in_a_call(8) == 8
    assert Config(display_step=100, steps_per_call=3).loop.steps_in_a_call(8) == 3


def test_stop_targets_are_reached_at_or_above_a_metric_and_at_or_below_a_loss():
    from gpupar.presets.mnist import mnist_run

    config, _, _ = mnist_run(Config(), MnistOptions(stop_at_accuracy=0.89))
    assert config.loop.reached({"val_accuracy": 0.89}) == "val_accuracy 0.8900 reached 0.89"
    assert not config.loop.reached({"val_accuracy": 0.8899})
    assert Config(stop_at="val_loss=0.5,accuracy=0.99").loop.reached({"val_loss": 0.5, "accuracy": 0.5})
    assert not Config(stop_at={"val_loss": 0.5}).loop.reached({"val_loss": 0.51})
    assert not Config().loop.reached({"val_accuracy": 1.0})
    with pytest.raises(GpuparError, match="stop_at='val_loss': give log names and targets"):
        Config(stop_at="val_loss")


def test_unknown_option_is_an_error_listing_valid_ones():
    with pytest.raises(GpuparError) as e:
        Config.from_options(epoch=3)
    assert "unknown option(s) epoch" in str(e.value) and "epochs" in str(e.value)
    with pytest.raises(GpuparError) as e:
        mnist_options(options={"modle": "lstm"})
    assert "unknown option(s) modle" in str(e.value) and "epochs" in str(e.value) and "lstm_units" in str(e.value)


def test_options_override_a_base_config():
    base = Config(epochs=2, batch_size=8)
    c = Config.from_options(base, batch_size=16)
    assert (c.loop.epochs, c.input.batch_size) == (2, 16)
    assert c.replace(seed=3).options() == {**c.options(), "seed": 3}


def test_lists_parse_from_strings_and_sequences():
    assert Config(gpus="0, 2").device_setup.gpus == (0, 2)
    assert Config(gpus=[1]).device_setup.gpus == (1,)
    assert Config(devices="/gpu:0,/GPU:1").distribution.devices == ("/gpu:0", "/GPU:1")
    assert Config(gpus="").device_setup.gpus is None
    assert Config(gpus=0).device_setup.gpus == (0,)
    assert Config(strategy="model_parallel", stages="conv_out, 3").distribution.stages == ("conv_out", 3)
    assert Config(strategy="model_parallel", stages=[1, "dense"]).distribution.stages == (1, "dense")


@pytest.mark.parametrize("where", [(), ("within_epoch",)])
def test_existing_checkpoints_need_resume(tmp_path, where):
    folder = tmp_path.joinpath(*where)
    folder.mkdir(exist_ok=True)
    (folder / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    with pytest.raises(GpuparError, match="already holds checkpoints"):
        Config(model_dir=str(tmp_path))
    assert Config(model_dir=str(tmp_path), resume=True).outputs.resume is True
