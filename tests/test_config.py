"""Config: one validated object for the API, the flags and the tests."""

import dataclasses

import pytest

from gpupar.config import Config, field_help, field_names
from gpupar.errors import GpuparError


def test_defaults_match_the_documented_api():
    c = Config()
    assert (c.epochs, c.batch_size, c.learning_rate, c.strategy, c.dataset, c.display_step) == (
        5, 1024, 1e-3, "auto", "mnist", 10,
    )


def test_every_field_has_help():
    helps = field_help()
    assert set(helps) == set(field_names())
    assert all(helps.values())


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().epochs = 3


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
        (dict(strategy="parameter_server", model="lstm"), "model=lstm is not available with strategy=parameter_server"),
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
        (dict(steps_per_call=0), "steps_per_call=0: must be a whole number > 0"),
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
    with pytest.raises(GpuparError, match=None) as e:
        Config.from_options(**options)
    assert message in str(e.value)


def test_steps_per_call_defaults_to_display_step_capped_at_the_epoch():
    assert Config(display_step=10).steps_in_a_call(58) == 10
    assert Config(display_step=100).steps_in_a_call(8) == 8
    assert Config(display_step=100, steps_per_call=3).steps_in_a_call(8) == 3


def test_stop_targets_are_reached_at_or_above_a_metric_and_at_or_below_a_loss():
    assert Config(stop_at_accuracy=0.89).reached({"val_accuracy": 0.89}) == "val_accuracy 0.8900 reached 0.89"
    assert not Config(stop_at_accuracy=0.89).reached({"val_accuracy": 0.8899})
    assert Config(stop_at="val_loss=0.5,accuracy=0.99").reached({"val_loss": 0.5, "accuracy": 0.5})
    assert not Config(stop_at={"val_loss": 0.5}).reached({"val_loss": 0.51})
    assert not Config().reached({"val_accuracy": 1.0})
    with pytest.raises(GpuparError, match="stop_at='val_loss': give log names and targets"):
        Config(stop_at="val_loss")


def test_unknown_option_is_an_error_listing_valid_ones():
    with pytest.raises(GpuparError) as e:
        Config.from_options(epoch=3)
    assert "unknown option(s) epoch" in str(e.value) and "epochs" in str(e.value)


def test_options_override_a_base_config():
    base = Config(epochs=2, batch_size=8)
    c = Config.from_options(base, batch_size=16)
    assert (c.epochs, c.batch_size) == (2, 16)


def test_lists_parse_from_strings_and_sequences():
    assert Config(gpus="0, 2").gpus == (0, 2)
    assert Config(gpus=[1]).gpus == (1,)
    assert Config(devices="/gpu:0,/GPU:1").devices == ("/gpu:0", "/GPU:1")
    assert Config(gpus="").gpus is None
    assert Config(gpus=0).gpus == (0,)
    assert Config(strategy="model_parallel", stages="conv_out, 3").stages == ("conv_out", 3)
    assert Config(strategy="model_parallel", stages=[1, "dense"]).stages == (1, "dense")


@pytest.mark.parametrize("where", [(), ("within_epoch",)])
def test_existing_checkpoints_need_resume(tmp_path, where):
    folder = tmp_path.joinpath(*where)
    folder.mkdir(exist_ok=True)
    (folder / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    with pytest.raises(GpuparError, match="already holds checkpoints"):
        Config(model_dir=str(tmp_path))
    assert Config(model_dir=str(tmp_path), resume=True).resume is True
