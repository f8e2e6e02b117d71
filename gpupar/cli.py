"""The `gpupar` command: absl flags, one per Config field, then a training run or another command.

    gpupar --dataset=fashion_mnist --data_dir=/usr/share/datasets/fashion-mnist --epochs=5
    gpupar devices [--virtual_cpus=2] [--gpus=0,1] [--json]    # what TF sees, what auto picks
    gpupar plot runs/001/metrics.json -o curves.png             # curves of a run
    gpupar diagnose --augment --augment_on=host [--json]        # input-bound or step-bound?
    gpupar launch --workers=2 [--ps=1] -- --epochs=2 ...        # a loopback cluster
    gpupar launch --workers=2 -- python train.py ...            # ... of any script
    gpupar --strategy=mirrored --virtual_cpus=2 --resume        # continue the latest run, on 2 replicas
    gpupar --help

Exit status: 0 on success, 1 when training fails with a gpupar error, 2 for a bad flag value,
130 / 143 after SIGINT / SIGTERM (a checkpoint was saved first).
"""

import dataclasses
import logging
import os
import sys
import textwrap
import typing

from absl import app, flags
from absl import logging as absl_logging

from gpupar.config import PARTS, Config, attribute_help
from gpupar.errors import GpuparError
from gpupar.monitor.bottleneck import MIN_STEPS
from gpupar.runtime.startup import start_tensorflow, wants_start_up_lines
from gpupar.runtime.teardown import exit_without_teardown

FLAGS = flags.FLAGS


def option_fields():
    """(name, default, help, type) of every training option, in the flags' order: the Config's parts, its seed,
    then the MNIST presets' options."""
    from gpupar.presets.mnist_options import PRESET_DEFAULTS, MnistOptions

    rows = []
    for part in [part for _, part in PARTS] + [MnistOptions]:
        helps, hints, defaults = part.field_help(), typing.get_type_hints(part), part()
        rows += [(f.name, PRESET_DEFAULTS.get(f.name, getattr(defaults, f.name)), helps[f.name], hints[f.name])
                 for f in dataclasses.fields(part)]
        if part is PARTS[-1][1]:
            rows.append(("seed", Config().seed, attribute_help(Config.__doc__)["seed"], int))
    return rows


def _define_flags():
    """Defines one flag per option, with its default and docstring help."""
    # absl.logging's --log_dir (for log files it only writes when asked) would shadow ours.
    if "log_dir" in FLAGS:
        delattr(FLAGS, "log_dir")
    for name, default, text, hint in option_fields():
        if name == "resume":
            flags.DEFINE_boolean("resume", False, "Continue from the latest checkpoint in --model_dir.")
            flags.DEFINE_string("resume_from", None, "Restore this checkpoint, e.g. runs/m/ckpt-3.")
        elif hint is bool:
            flags.DEFINE_boolean(name, default, text)
        elif int in (hint, *typing.get_args(hint)) and str not in typing.get_args(hint):
            flags.DEFINE_integer(name, default, text)
        elif float in (hint, *typing.get_args(hint)):
            flags.DEFINE_float(name, default, text)
        else:  # strings, and comma-separated lists that the options parse
            flags.DEFINE_string(name, None if default is None else str(default), text)


_define_flags()
flags.DEFINE_boolean("json", False, "gpupar devices / diagnose: print JSON instead of text.")
flags.DEFINE_boolean("check", False, "gpupar devices: check that the GPUs work (NVML, memory settings, an all-reduce, "
                     "XLA, mixed_float16 steps): PASS, FAIL with the fix, or NOT RUN.")
flags.DEFINE_string("output", "curves.png", "gpupar plot: the PNG to write.", short_name="o")
flags.DEFINE_integer("diagnose_steps", 30, "gpupar diagnose: timed steps in each of its three measurements.",
                     lower_bound=MIN_STEPS)
flags.DEFINE_integer("workers", 2, "gpupar launch: worker tasks.", lower_bound=1)
flags.DEFINE_integer("ps", 0, "gpupar launch: parameter-server tasks; more than 0 adds a chief (the coordinator).",
                     lower_bound=0)
flags.DEFINE_integer("restarts", 0, "gpupar launch: times to restart after a task fails (the cluster, or a "
                     "parameter-server worker alone).", lower_bound=0)
flags.DEFINE_integer("gpus_per_worker", None, "gpupar launch: GPUs each worker gets (its CUDA_VISIBLE_DEVICES); "
                     "empty shares the visible GPUs evenly, 0 trains on CPUs. The chief and ps tasks get none.",
                     lower_bound=0)
flags.DEFINE_bool("allow_network", False, "gpupar launch: run the tasks on this machine's network, where other "
                  "machines can reach their unauthenticated TensorFlow servers, instead of a private network "
                  "namespace (for machines without one).")


HELP = {
    None: ("gpupar [flags]", "Trains as the flags say (by default the MNIST ConvNet on every device), evaluating "
           "and saving a checkpoint after every epoch."),
    "devices": ("gpupar devices [--check] [--json] [device flags]", "Lists the devices TensorFlow sees and the "
                "strategy and all-reduce auto would pick, and why; --check runs a minute of checks of the GPU set-up."),
    "diagnose": ("gpupar diagnose [--json] [--diagnose_steps=30] [training flags]", "Measures the input pipeline "
                 "alone, the train step alone and both together under the training flags, and says which bounds "
                 "training and what to change."),
    "plot": ("gpupar plot METRICS.json -o curves.png", "Draws loss, accuracy and speed per epoch from a metrics "
             "file (--metrics_json, or metrics.json in a run folder) into a PNG."),
    "launch": ("gpupar launch [--workers=2] [--ps=0] [--restarts=0] -- [training flags | command]", "Runs a gpupar "
               "cluster on this machine: each task is `python -m gpupar` with the training flags after -- (or the "
               "command after --, e.g. python train.py), with its own TF_CONFIG on 127.0.0.1, in a private network "
               "namespace that nothing outside the launcher reaches, its output prefixed with its name."),
}
_COMMAND_FLAGS = {"devices": ("json", "check"), "diagnose": ("json", "diagnose_steps"), "plot": ("output",),
                  "launch": ("workers", "ps", "restarts", "gpus_per_worker", "allow_network")}
HELP_FLAGS = ("--help", "-h", "--helpshort", "-?")


def flag_rows():
    """(flag, default, help) for every flag of training, in the options' order: what --help and docs/flags.md list."""
    rows = []
    for name, default, text, _ in option_fields():
        if name == "resume":
            rows.append(("--resume", "False", "Continue from the latest checkpoint in --model_dir (empty: the latest "
                                              "run under runs/)."))
            rows.append(("--resume_from=PATH", "", "Restore this checkpoint, e.g. runs/001/ckpt-3."))
        elif isinstance(default, bool):
            rows.append((f"--[no]{name}", str(default), text))
        else:
            rows.append((f"--{name}=...", "" if default is None else str(default), text))
    return rows


def flags_markdown() -> str:
    """docs/flags.md: the table of every flag, generated from Config's field docstrings (make docs)."""
    lines = ["# Flags", "", "Generated from `gpupar.Config` and `gpupar.MnistOptions` by `make docs`; the same names "
             "are the options of `gpupar.fit_mnist`, and all but the MNIST presets' (dataset through "
             "stop_at_accuracy) those of `gpupar.fit`. Every flag is optional.", "",
             "| flag | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{flag}` | {f'`{default}`' if default else ''} | {text.replace('|', '/')} |"
              for flag, default, text in flag_rows()]
    lines += ["", "Commands' own flags:", "", "| flag | default | meaning |", "| --- | --- | --- |"]
    names = dict.fromkeys(name for command_flags in _COMMAND_FLAGS.values() for name in command_flags)
    lines += [f"| `--{name}` | `{FLAGS[name].default}` | {FLAGS[name].help} |" for name in names]
    return "\n".join(lines) + "\n"


def help_text(command=None) -> str:
    """What `gpupar [COMMAND] --help` prints: what the command does, then its flags."""
    usage, summary = HELP[command]
    lines = [f"usage: {usage}", "", textwrap.fill(summary, 100), ""]
    if command is None:
        lines.append("commands:")
        lines += [textwrap.fill(text[1], 100, initial_indent=f"  {name:<10}", subsequent_indent=" " * 12)
                  for name, text in HELP.items() if name]
        lines += ["", "flags (every one optional; absl's own: --helpfull):"]
    if command in (None, "devices", "diagnose"):
        for flag, default, text in flag_rows():
            lines.append(f"  {flag} (default {default})" if default else f"  {flag}")
            lines.append(textwrap.fill(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    for name in _COMMAND_FLAGS.get(command, ()):
        lines.append(f"  --{name} (default {FLAGS[name].default}): {FLAGS[name].help}")
    if command in ("devices", "diagnose"):
        lines.insert(4, "It takes training's flags:")
    return "\n".join(lines)


def _error(message, status):
    print(f"gpupar: error: {message}", file=sys.stderr)
    return status


def _plot(args):
    from gpupar.commands import plot

    if len(args) != 1:
        return _error("usage: gpupar plot METRICS.json -o OUTPUT.png (one metrics file)", 2)
    try:
        history, title = plot.load_history(args[0])
        plot.plot_history(history, FLAGS.output, title)
    except GpuparError as e:
        return _error(e, 1)
    print(f"wrote {FLAGS.output}")
    return 0


def _devices(config, preset):
    from gpupar.commands import device_check, device_report

    try:
        if FLAGS.check:
            results = device_check.run_checks(config)
            print(device_check.to_json(results) if FLAGS.json else device_check.format_checks(results), flush=True)
            return 1 if any(c.status == device_check.FAIL for c in results) else 0
        report = device_report.collect_report(config)
    except GpuparError as e:
        return _error(e, 1)
    print(device_report.to_json(report) if FLAGS.json else device_report.format_report(report))
    return 0


def _diagnose(config, preset):
    from gpupar import diagnose_mnist
    from gpupar.training.run import log_level

    try:
        # --json: the JSON alone on stdout, for machines; the set-up's log lines are then left out.
        with log_level(logging.ERROR if FLAGS.json else None):
            report = diagnose_mnist(config, FLAGS.diagnose_steps, preset)
    except GpuparError as e:
        return _error(e, 1)
    print(report.to_json() if FLAGS.json else report.format(), flush=True)
    return 0


def config_from_flags():
    """(the Config, the MNIST preset's options) that the parsed flags describe."""
    from gpupar.presets.mnist_options import mnist_options

    options = {name: FLAGS[name].value for name, *_ in option_fields()}
    options["resume"] = FLAGS.resume_from or FLAGS.resume
    return mnist_options(options=options)


def _launch(task_flags):
    from gpupar.runtime import launch

    given = sorted(name for name, *_ in option_fields() if FLAGS[name].present)
    if given:
        return _error(f"--{given[0]} is a training flag: put it after --, e.g. gpupar launch --workers=2 -- "
                      f"--{given[0]}=...", 2)
    try:
        return launch.launch(FLAGS.workers, FLAGS.ps, FLAGS.restarts, task_flags, FLAGS.gpus_per_worker,
                             FLAGS.allow_network)
    except GpuparError as e:
        return _error(e, 2)


def _train(config, preset):
    from gpupar.presets.mnist import mnist_run
    from gpupar.training.interrupt import TrainingInterrupted
    from gpupar.training.run import train_and_evaluate

    try:
        run = mnist_run(config, preset)  # the options the run's mode cannot run: bad flag values
    except GpuparError as e:
        return _error(e, 2)
    try:
        train_and_evaluate(*run)
    except TrainingInterrupted as e:
        print(f"gpupar: {e}", file=sys.stderr)
        return e.exit_status
    except GpuparError as e:
        return _error(e, 1)
    return 0


_RUNS = {None: _train, "devices": _devices, "diagnose": _diagnose}


def main(argv, show_start_up_lines=False):
    """Runs a command, or by default validates the flags into a Config and trains.

    Errors become one line on stderr and an exit status.
    """
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines drown ours.
    command, args = (argv[1], argv[2:]) if len(argv) > 1 else (None, [])
    if command == "plot":
        return _plot(args)
    if command == "launch":  # absl left what follows -- in argv: the flags of every task
        return _launch(args)
    if command is not None and command not in _RUNS:
        return _error(f"unexpected argument {command!r}; commands are {', '.join(c for c in HELP if c)} (or none, "
                      "to train), and flags look like --epochs=5", 2)
    if args:
        return _error(f"unexpected argument(s) {' '.join(args)} after {command}", 2)
    try:
        config, preset = config_from_flags()
    except GpuparError as e:
        return _error(e, 2)
    start_tensorflow(show_start_up_lines)
    return _RUNS[command](config, preset)


def run():
    """Console-script entry point."""
    argv = sys.argv[1:]
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if any(a in HELP_FLAGS for a in argv[:argv.index("--") if "--" in argv else len(argv)]):
        if command not in HELP:
            sys.exit(_error(f"no command {command!r}; commands are {', '.join(c for c in HELP if c)}", 2))
        print(help_text(command))
        sys.exit(0)
    show = wants_start_up_lines(argv, os.environ)  # before TensorFlow is imported
    app.run(lambda parsed: exit_without_teardown(main(parsed, show)))
