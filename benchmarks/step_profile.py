"""Where the time goes at one replica: an op-level profile of model.fit at its best and of gpupar.fit, side by side.

    python -m benchmarks.step_profile                       # about 3 minutes on an idle 2-core machine
    python -m benchmarks.step_profile --examples=mnist_convnet --scale=1 --json=/tmp/profile.json   # the tests' data

For each keras-io program (benchmarks.keras_io's ports, at their default scales or --scale), two fresh
processes train it for 3 epochs at one replica in float32, as benchmarks.keras_io does: Keras'
model.fit with steps_per_execution=10 (its tuned loop) and gpupar.fit (10 steps per call by
default). TensorFlow's profiler records the second epoch's training (from on_epoch_begin to
on_test_begin, or on_epoch_end without validation: no tracing, no evaluation). The tables give
each kind of op's self time on the host's threads in that epoch (an op's time less that of the
ops it ran inside, summed over every event of that kind; TensorFlow's executor shows as "Run"
and "Process", its scheduling and its waits, tf.data's threads as theirs), the top ones of either runner, the total, and
each run's examples/s over epochs 2-3. Both runners run the same layers' kernels; what differs
is what each adds around them.
"""

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import keras_io, script  # noqa: E402

FLAGS = flags.FLAGS
EXAMPLES = ("bidirectional_lstm_imdb", "mnist_convnet")
RUNNERS = ("tuned", "gpupar")  # model.fit at its best, gpupar.fit (benchmarks.keras_io's names)
PROFILED_EPOCH = 1  # the second: the first traces
TOP = 10  # op kinds in each table
RESULT = "STEP_PROFILE "


def define_flags():
    """The benchmark's flags, and the worker's."""
    flags.DEFINE_list("examples", list(EXAMPLES), f"keras-io programs to profile, of {', '.join(keras_io.EXAMPLES)}.")
    flags.DEFINE_integer("scale", None, "Synthetic data: this many times the tests' size; empty: each program's own.",
                         lower_bound=1)
    flags.DEFINE_string("json", "runs/step_profile.json", "Write the results here; empty for none.")
    flags.DEFINE_string("worker", None, "Internal: profile EXAMPLE,RUNNER in this process and print the result.")


def self_times(xspace) -> tuple:
    """({op kind: self seconds}, {op kind: events}) over the host's threads of a profile (an XSpace).

    A TensorFlow op's event is named "name:Type" and counts under its type; any other event (the
    executor's, tf.data's) under its own name in brackets. An event's self time is its duration
    less that of the events nested in it on the same thread.
    """
    seconds, events = collections.Counter(), collections.Counter()
    for plane in xspace.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            spans = sorted(((e.offset_ps, e.duration_ps, plane.event_metadata[e.metadata_id].name)
                            for e in line.events), key=lambda span: (span[0], -span[1]))
            open_spans, selves = [], []
            for start, duration, name in spans:
                while open_spans and open_spans[-1][0] + open_spans[-1][1] <= start:
                    open_spans.pop()
                if open_spans:
                    selves[open_spans[-1][2]][1] -= duration
                selves.append([name, duration])
                open_spans.append((start, duration, len(selves) - 1))
            for name, duration in selves:
                kind = name.rsplit(":", 1)[1] if ":" in name and not name.startswith("$") else f"[{name[:50]}]"
                seconds[kind] += duration / 1e12
                events[kind] += 1
    return dict(seconds), dict(events)


def work(example: str, runner: str, scale: int):
    """Trains the program with the runner, profiling one epoch's training, and prints the RESULT line."""
    import keras
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    folder = tempfile.mkdtemp(prefix="step_profile_")

    class Profile(keras.callbacks.Callback):
        """TensorFlow's profiler over PROFILED_EPOCH's training alone."""

        on, seconds = False, None

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == PROFILED_EPOCH:
                tf.profiler.experimental.start(folder)
                self.on, self.began = True, time.perf_counter()

        def _stop(self):
            if self.on:
                self.seconds = time.perf_counter() - self.began
                tf.profiler.experimental.stop()
                self.on = False

        def on_test_begin(self, logs=None):
            self._stop()

        def on_epoch_end(self, epoch, logs=None):
            self._stop()

    profile = Profile()
    keras_io.work(example, runner, 1, "float32", 0, scale, 3, "gpupar", callbacks=[profile])
    xspace = xplane_pb2.XSpace()
    with open(sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))[-1], "rb") as f:
        xspace.ParseFromString(f.read())
    seconds, events = self_times(xspace)
    print(RESULT + json.dumps({"profiled_seconds": profile.seconds, "self_seconds": seconds, "events": events}),
          flush=True)


def run_worker(example: str, runner: str, scale: int) -> dict:
    """Profiles one (program, runner) in a fresh process: its profile and its keras_io result."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", f"--worker={example},{runner}",
                           f"--scale={scale}", "--json="],
                          capture_output=True, text=True, cwd=script.ROOT)
    results = {prefix: [json.loads(line[len(prefix):]) for line in done.stdout.splitlines() if line.startswith(prefix)]
               for prefix in (RESULT, keras_io.RESULT)}
    if done.returncode != 0 or not all(results.values()):
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise RuntimeError(f"benchmarks.step_profile: {example} {runner} failed (status {done.returncode})")
    return {**results[RESULT][-1], "run": results[keras_io.RESULT][-1]}


def table(report: dict) -> str:
    """Per program: the top op kinds' self milliseconds in the profiled epoch, each runner side by side."""
    names = [keras_io.NAMES[r] for r in RUNNERS]
    lines = []
    for example, runs in report["programs"].items():
        by_kind = [runs[r]["self_seconds"] for r in RUNNERS]
        kinds = sorted(set().union(*by_kind), key=lambda k: -max(s.get(k, 0.0) for s in by_kind))[:TOP]
        lines += [f"{example} (data scale {report['scales'][example]}), one replica, float32, epoch "
                  f"{PROFILED_EPOCH + 1}'s training:", "",
                  "| op kind (host self ms, events) | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for kind in kinds:
            lines.append(f"| {kind} | " + " | ".join(f"{1e3 * runs[r]['self_seconds'].get(kind, 0.0):,.0f} "
                                                    f"({runs[r]['events'].get(kind, 0):,})" for r in RUNNERS) + " |")
        lines.append("| all ops | " + " | ".join(f"{1e3 * sum(runs[r]['self_seconds'].values()):,.0f}"
                                                  for r in RUNNERS) + " |")
        lines.append("| the epoch's wall ms | " + " | ".join(f"{1e3 * runs[r]['profiled_seconds']:,.0f}"
                                                            for r in RUNNERS) + " |")
        lines.append("| examples/s, epochs 2-3 | " + " | ".join(f"{runs[r]['run']['examples_per_second']:,.0f}"
                                                                for r in RUNNERS) + " |")
        lines.append("")
    lines.append(f"One process per cell; profiled under TensorFlow's profiler, so slower than unprofiled; "
                 f"{report['seconds']:.0f} s in all.")
    return "\n".join(lines)


def main() -> int:
    """The driver (or, with --worker, one profile)."""
    if FLAGS.worker:
        work(*FLAGS.worker.split(","), FLAGS.scale)
        return 0
    unknown = sorted(set(FLAGS.examples) - set(keras_io.EXAMPLES))
    if unknown:
        raise script.UsageError(f"--examples: unknown {', '.join(unknown)}; choose from {', '.join(keras_io.EXAMPLES)}")
    started = time.perf_counter()
    scales = {example: FLAGS.scale or keras_io.SCALES[example] for example in FLAGS.examples}
    programs = {example: {runner: run_worker(example, runner, scales[example]) for runner in RUNNERS}
                for example in FLAGS.examples}
    report = {"programs": programs, "scales": scales, "seconds": time.perf_counter() - started}
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.step_profile", define_flags, main)
