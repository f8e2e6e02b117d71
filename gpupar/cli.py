"""The `gpupar` command: absl flags, one per Config field, then one training run.

    gpupar --dataset=fashion_mnist --data_dir=/usr/share/datasets/fashion-mnist --epochs=5
    gpupar --strategy=mirrored --virtual_cpus=2 --dataset=fashion_mnist \
        --data_dir=/usr/share/datasets/fashion-mnist --model_dir=runs/m --resume
    python -m gpupar --helpfull

Exit status: 0 on success, 1 when training fails with a gpupar error, 2 for a bad flag value,
130 / 143 after SIGINT / SIGTERM (a checkpoint was saved first).
"""

import dataclasses
import os
import sys
import typing

from absl import app, flags
from absl import logging as absl_logging

from gpupar.config import Config, field_help
from gpupar.errors import GpuparError

FLAGS = flags.FLAGS
_DEFAULTS = Config()


def _define_flags():
    """Defines one flag per Config field, with the field's default and docstring help."""
    # absl.logging's --log_dir (for log files it only writes when asked) would shadow ours.
    if "log_dir" in FLAGS:
        delattr(FLAGS, "log_dir")
    helps = field_help()
    hints = typing.get_type_hints(Config)
    for field in dataclasses.fields(Config):
        name, default, text = field.name, getattr(_DEFAULTS, field.name), helps[field.name]
        hint = hints[name]
        if name == "resume":
            flags.DEFINE_boolean("resume", False, "Continue from the latest checkpoint in --model_dir.")
            flags.DEFINE_string("resume_from", None, "Restore this checkpoint, e.g. runs/m/ckpt-3.")
        elif hint is bool:
            flags.DEFINE_boolean(name, default, text)
        elif int in (hint, *typing.get_args(hint)):
            flags.DEFINE_integer(name, default, text)
        elif float in (hint, *typing.get_args(hint)):
            flags.DEFINE_float(name, default, text)
        else:  # strings, and comma-separated lists that Config parses
            flags.DEFINE_string(name, None if default is None else str(default), text)


_define_flags()


def config_from_flags() -> Config:
    """The Config the parsed flags describe."""
    options = {f.name: FLAGS[f.name].value for f in dataclasses.fields(Config)}
    options["resume"] = FLAGS.resume_from or FLAGS.resume
    return Config(**options)


def main(argv):
    """Validates the flags into a Config, then trains; errors become one line and an exit status."""
    if len(argv) > 1:
        print(f"gpupar: error: unexpected argument(s) {' '.join(argv[1:])}; flags look like --epochs=5", file=sys.stderr)
        return 2
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines drown ours.
    try:
        config = config_from_flags()
    except GpuparError as e:
        print(f"gpupar: error: {e}", file=sys.stderr)
        return 2
    from gpupar.interrupt import TrainingInterrupted
    from gpupar.train import train_and_evaluate

    try:
        train_and_evaluate(config)
    except TrainingInterrupted as e:
        print(f"gpupar: {e}", file=sys.stderr)
        return e.exit_status
    except GpuparError as e:
        print(f"gpupar: error: {e}", file=sys.stderr)
        return 1
    return 0


def _main_and_exit(argv):
    status = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skips interpreter teardown, where destroying tf.data iterators can block for many
    # seconds (see data.keep_for_process); all output is flushed and checkpoints are closed.
    os._exit(status)


def run():
    """Console-script entry point."""
    app.run(_main_and_exit)
