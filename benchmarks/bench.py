"""gpupar against Keras model.fit and the classic TF1 tower code, and each speed option on and off.

    python -m benchmarks.bench                        # about 14 minutes on 2 cores (make bench)
    python benchmarks/bench.py --json=runs/bench.json --plot=runs/bench.png
    python -m benchmarks.bench --replicas=1 --only='^(gpupar|model.fit)$' --steps=2 --repeats=1 --batch_size=16 \
        --accuracy_target=0

Every configuration runs in a process of its own (benchmarks/workers.py: thread pools, virtual
CPUs and precision are fixed per process). They start one after another, so that set-up times
are not disturbed; then in each round every process times `steps` steps in turn, so machine
noise hits all of them alike. Besides gpupar and model.fit, the classic TF1 tower code
(benchmarks/towers.py) runs as the baseline multi-device code is usually measured against. Per
configuration it reports the median and spread of images/s, the CPU cores it kept busy (CPU time
over wall time, spinning threads included), the ratio to model.fit with the same replicas (median
of the per-round ratios), the fraction of the roofline (the matrix-op FLOPs of a Keras train
step at this machine's matrix-multiply rate), seconds to the first step and peak memory. For
gpupar's default configuration it then shows where the time goes (input wait, step and host from in-graph
timestamps; op time by kind from a TensorBoard profile) and, last, trains it to a test accuracy
(`--accuracy_target`) and reports the time.
"""

import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

if __package__ in (None, ""):  # run as a file, python benchmarks/bench.py: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import script  # noqa: E402

FLAGS = flags.FLAGS

GPUPAR, FIT, TOWERS = "gpupar", "model.fit", "TF1 tower code"
USER_GPUPAR, USER_FIT = "gpupar.fit, a user CNN", "model.fit, a user CNN"
TUNED_STEPS_PER_EXECUTION = 10  # as gpupar's calls: display_step steps


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One row of the benchmark.

    Attributes:
      name: What the row shows, e.g. "gpupar jit_compile".
      runner: gpupar, fit, towers or matmul (benchmarks.workers.RUNNERS).
      replicas: Data-parallel replicas (virtual CPUs on a machine without GPUs).
      options: Config options (gpupar) or fit settings (steps_per_execution, gpupar_threads).
    """

    name: str
    runner: str
    replicas: int
    options: Tuple[Tuple[str, object], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.name} x{self.replicas}"


def configurations(replicas=(1, 2, 4), gpu: bool = False) -> List[Configuration]:
    """The rows: gpupar's default, model.fit (default and tuned) and the TF1 tower code per replica count,
    then the options.

    Options are each turned on (or gpupar's own choice off) alone, against the default: at 1
    replica steps_per_call=1 (gpupar picks display_step), jit_compile and the machine's mixed
    precision; with several replicas, TensorFlow's thread pools instead of gpupar's, for gpupar
    and for model.fit. One more model.fit row runs the ConvNet with Keras' own batch norm layer:
    what plain Keras code gets. Last, gpupar.fit against model.fit on a CNN of a user's
    (benchmarks/user_model.py) at 1 and 2 replicas.
    """
    rows = []
    for r in replicas:
        rows += [Configuration(GPUPAR, "gpupar", r), Configuration(FIT, "fit", r),
                 Configuration(f"{FIT} steps_per_execution={TUNED_STEPS_PER_EXECUTION}", "fit", r,
                               (("steps_per_execution", TUNED_STEPS_PER_EXECUTION),)),
                 Configuration(TOWERS, "towers", r)]
    user = (("user_model", True),)
    rows += [Configuration(name, runner, r, user) for r in replicas if r <= 2
             for name, runner in ((USER_GPUPAR, "gpupar"), (USER_FIT, "fit"))]
    if 1 in replicas:
        mixed = "mixed_float16" if gpu else "mixed_bfloat16"
        rows += [Configuration(f"{FIT}, Keras' BatchNormalization", "fit", 1, (("keras_batch_norm", True),)),
                 Configuration(f"{GPUPAR} steps_per_call=1", "gpupar", 1, (("steps_per_call", 1),)),
                 Configuration(f"{GPUPAR} jit_compile", "gpupar", 1, (("jit_compile", True),)),
                 Configuration(f"{GPUPAR} {mixed}", "gpupar", 1, (("precision", mixed),))]
    several = [r for r in replicas if r > 1]
    if several and not gpu:
        r = several[0]
        rows += [Configuration(f"{GPUPAR} TensorFlow's threads", "gpupar", r,
                               (("intra_op_threads", 0), ("inter_op_threads", 0))),
                 Configuration(f"{FIT} gpupar's threads", "fit", r, (("gpupar_threads", True),))]
    return rows


class Worker:
    """A benchmarks.workers process for one configuration, answering one command at a time."""

    def __init__(self, configuration: Configuration, settings: "Settings", log_dir: str):
        self.configuration = configuration
        self.log_path = os.path.join(log_dir, re.sub(r"\W+", "_", configuration.key) + ".log")
        self.log = open(self.log_path, "w")
        worker_flags = [f"--runner={configuration.runner}", f"--replicas={configuration.replicas}",
                        f"--data_dir={settings.data_dir}", f"--batch_size={settings.batch_size}",
                        f"--steps={timed_steps(configuration, settings.steps)}",
                        f"--options={json.dumps(dict(configuration.options))}"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.workers", *worker_flags], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=script.ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )

    def read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("BENCH "):
                return json.loads(line[len("BENCH "):])
        self.process.wait()
        with open(self.log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{self.configuration.key}: its worker ended (status {self.process.returncode}):\n{tail}")

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


def timed_steps(row: Configuration, steps: int) -> int:
    """`steps`, rounded up to whole model.fit executions (fit runs steps_per_execution at a time)."""
    per_execution = dict(row.options).get("steps_per_execution", 1) if row.runner == "fit" else 1
    return math.ceil(steps / per_execution) * per_execution


def _spread(values: List[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _paired_ratio(numerators: List[float], denominators: List[float]) -> float:
    """Median over rounds of the ratio within each round: noise that hits a whole round cancels."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def summarise(rows: List[Configuration], ready: Dict[str, dict], runs: Dict[str, List[dict]], memory: Dict[str, dict],
              matmul: Optional[dict], flops_per_image: Optional[float]) -> List[dict]:
    """One JSON-ready record per configuration: rates, spread, ratios, roofline, first step, memory."""
    rates = {key: [r["images_per_second"] for r in values] for key, values in runs.items()}
    records = []
    for row in rows:
        if row.runner == "matmul":
            continue
        key = row.key
        record = {"name": row.name, "replicas": row.replicas, "options": dict(row.options),
                  "strategy": ready[key]["strategy"], "steps_per_call": ready[key]["steps_per_call"],
                  "images_per_second": rates[key], **_spread(rates[key]),
                  "first_step_seconds": ready[key]["first_step_seconds"], "peak_memory": memory.get(key),
                  "cores_busy": statistics.median(r["cores_busy"] for r in runs[key])}
        fit = f"{USER_FIT if row.name == USER_GPUPAR else FIT} x{row.replicas}"
        if fit in rates and key != fit:
            record["vs_model_fit"] = _paired_ratio(rates[key], rates[fit])
        single = Configuration(row.name, row.runner, 1, row.options).key
        if row.replicas > 1 and single in rates:
            record["vs_one_replica"] = _paired_ratio(rates[key], rates[single])
        if matmul and flops_per_image and not dict(row.options).get("user_model"):  # the ConvNet's FLOPs
            peak = matmul["bfloat16_flops" if "bfloat16" in row.name else "float32_flops"]
            record["roofline_fraction"] = record["median"] * flops_per_image / peak
        if row.runner == "gpupar":
            totals = {part: sum(r[f"{part}_seconds"] for r in runs[key]) for part in ("input_wait", "step", "host")}
            whole = sum(r["seconds"] for r in runs[key])
            record["time_shares"] = {part: seconds / whole for part, seconds in totals.items()}
        records.append(record)
    return records


def headlines(runs: Dict[str, List[dict]]) -> Dict[str, float]:
    """The ratios the speed targets are about, each the median of per-round ratios."""
    rates = {key: [r["images_per_second"] for r in values] for key, values in runs.items()}
    pairs = {
        "gpupar / model.fit, same model, 1 replica": ("gpupar x1", "model.fit x1"),
        "gpupar / model.fit on Keras' BatchNormalization (plain Keras), 1 replica":
            ("gpupar x1", "model.fit, Keras' BatchNormalization x1"),
        "gpupar 2 replicas / 1 replica": ("gpupar x2", "gpupar x1"),
        "gpupar 4 replicas / 1 replica": ("gpupar x4", "gpupar x1"),
        "TF1 tower code 2 towers / 1 tower": (f"{TOWERS} x2", f"{TOWERS} x1"),
        "gpupar.fit / model.fit, a user CNN, 1 replica": (f"{USER_GPUPAR} x1", f"{USER_FIT} x1"),
        "gpupar.fit / model.fit, a user CNN, 2 replicas": (f"{USER_GPUPAR} x2", f"{USER_FIT} x2"),
        "gpupar / TF1 tower code, 1 replica": ("gpupar x1", f"{TOWERS} x1"),
        "gpupar / TF1 tower code, 2 replicas": ("gpupar x2", f"{TOWERS} x2"),
    }
    return {text: _paired_ratio(rates[a], rates[b]) for text, (a, b) in pairs.items() if a in rates and b in rates}


def table(report: dict) -> str:
    """The report as markdown: one row per configuration, then the ratios, roofline, profile and accuracy lines."""
    lines = ["| configuration | replicas | img/s median | min-max | vs fit | x1 repl. | roofline | cores | 1st step s "
             "| peak MB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["configurations"]:
        memory = (r["peak_memory"] or {}).get("gpu_mb", (r["peak_memory"] or {}).get("host_mb"))
        lines.append(
            f"| {r['name']} | {r['replicas']} | {r['median']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} "
            f"| {_times(r.get('vs_model_fit'))} | {_times(r.get('vs_one_replica'))} "
            f"| {_percent(r.get('roofline_fraction'))} | {r['cores_busy']:.2f} | {r['first_step_seconds']:.1f} "
            f"| {'' if memory is None else f'{memory:,.0f}'} |")
    lines.append("")
    notes = []
    for text, ratio in report.get("headlines", {}).items():
        notes.append(f"{text}: {ratio:.2f}x")
    if report.get("flops_per_image"):
        notes.append(f"roofline: {report['flops_per_image'] / 1e6:.2f} MFLOP per image (the matrix ops of a "
                     f"train step) at the matmul rate, float32 {report['matmul']['float32_flops'] / 1e9:,.0f} GFLOP/s, "
                     f"bfloat16 {report['matmul']['bfloat16_flops'] / 1e9:,.0f} GFLOP/s")
    for r in report["configurations"]:
        if r["name"] == GPUPAR and "time_shares" in r:
            shares = ", ".join(f"{part.replace('_', ' ')} {share:.0%}" for part, share in r["time_shares"].items())
            notes.append(f"gpupar x{r['replicas']}, where the time goes: {shares} ({r['strategy']})")
    for replicas, seconds in report.get("op_seconds", {}).items():
        total = sum(v for k, v in seconds.items() if not k.startswith("input"))
        parts = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
                          if not k.startswith("input"))
        notes.append(f"gpupar x{replicas}, op time by kind (profile): {parts}")
    accuracy = report.get("time_to_accuracy")
    if accuracy:
        reached = "reached" if accuracy["reached"] else "did NOT reach"
        notes.append(f"time to {accuracy['target']} test accuracy (gpupar default, 1 replica): {reached} "
                     f"{accuracy['test_accuracy']:.4f} after {accuracy['epochs']} epoch(s), "
                     f"{accuracy['seconds']:.0f} s for the whole command")
    return "\n".join(lines + [f"- {note}" for note in notes])


def _times(value):
    return "" if value is None else f"{value:.2f}x"


def _percent(value):
    return "" if value is None else f"{value:.1%}"


def plot(report: dict, path: str):
    """A PNG of images/s per configuration (median, with the min-max spread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["configurations"]
    labels = [f"{r['name']}  x{r['replicas']}" for r in rows]
    medians = [r["median"] for r in rows]
    errors = [[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]]
    colours = ["tab:blue" if r["name"].startswith(GPUPAR) else "tab:grey" if r["name"] == TOWERS else "tab:orange"
               for r in rows]
    figure, axes = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    axes.barh(range(len(rows)), medians, xerr=errors, color=colours, capsize=3)
    axes.set_yticks(range(len(rows)), labels)
    axes.invert_yaxis()
    axes.set_xlabel("training images/s (median of rounds; bars: min-max)")
    axes.set_title(f"benchmarks/bench.py: batch {report['batch_size']} per replica, {report['machine']['cores']} cores")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def time_to_accuracy(data_dir: str, target: float, max_epochs: int, work_dir: str) -> dict:
    """Trains gpupar's default configuration until `target` test accuracy; the command's wall time."""
    metrics = os.path.join(work_dir, "accuracy_metrics.json")
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gpupar", "--dataset=fashion_mnist", f"--data_dir={data_dir}", "--nosave",
         f"--epochs={max_epochs}", f"--stop_at_accuracy={target}", f"--metrics_json={metrics}"],
        capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the accuracy run failed (status {done.returncode}):\n{done.stderr[-3000:]}")
    with open(metrics) as f:
        result = json.load(f)
    return {"target": target, "seconds": seconds, "epochs": len(result["history"]),
            "test_accuracy": result["logs"]["val_accuracy"], "reached": result["logs"]["val_accuracy"] >= target,
            "training_seconds": result["total_seconds"]}


def benchmark(settings: "Settings", rows: List[Configuration], say=print) -> dict:
    """Starts a worker per configuration, runs the rounds, profiles, and returns the JSON-ready report."""
    work_dir = tempfile.mkdtemp(prefix="gpupar-bench-")
    workers, ready = [], {}
    try:
        for row in [Configuration("matmul", "matmul", 1), *rows]:
            say(f"starting {row.key}")
            worker = Worker(row, settings, work_dir)
            workers.append(worker)
            ready[row.key] = worker.read()  # one at a time: set-up times undisturbed
        runs = {w.configuration.key: [] for w in workers}
        for round_ in range(settings.repeats):
            order = workers[round_ % len(workers):] + workers[:round_ % len(workers)]  # drift spreads over rows
            for worker in order:
                runs[worker.configuration.key].append(worker.ask("run"))
            say(f"round {round_ + 1} of {settings.repeats} done")
        op_seconds = {}
        for worker in workers:
            row = worker.configuration
            if row.name == GPUPAR and row.replicas in (1, 2):
                profile_dir = os.path.join(work_dir, f"profile_x{row.replicas}")
                op_seconds[str(row.replicas)] = worker.ask(f"profile {profile_dir}")["op_seconds"]
        memory = {w.configuration.key: w.ask("quit")["peak_memory"] for w in workers}
    finally:
        for worker in workers:
            worker.stop()
    matmul_runs = runs.pop("matmul x1")
    matmul = {k: statistics.median(r[k] for r in matmul_runs) for k in ("float32_flops", "bfloat16_flops")}
    report = {
        "machine": {"cores": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
                    "cpu": _cpu_name(), "platform": sys.platform, "python": sys.version.split()[0]},
        "data_dir": settings.data_dir, "batch_size": settings.batch_size, "steps": settings.steps, "repeats": settings.repeats,
        "flops_per_image": ready["matmul x1"]["flops_per_image"], "matmul": matmul,
        "configurations": summarise(rows, ready, runs, memory, matmul, ready["matmul x1"]["flops_per_image"]),
        "op_seconds": op_seconds,
        "headlines": headlines(runs),
    }
    if settings.accuracy_target:
        say(f"training gpupar's default configuration to {settings.accuracy_target} test accuracy")
        report["time_to_accuracy"] = time_to_accuracy(settings.data_dir, settings.accuracy_target, settings.accuracy_epochs,
                                                      work_dir)
    return report


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def define_flags():
    """The benchmark's flags (defined when it runs: gpupar's command has --data_dir and --batch_size too)."""
    flags.DEFINE_string("data_dir", None, f"Fashion-MNIST IDX folder; empty: {script.DEFAULT_DATA_DIR}.")
    flags.DEFINE_string("json", "runs/bench.json", "Write the report here.")
    flags.DEFINE_string("plot", "runs/bench.png", "Write the images/s plot here; empty for none.")
    flags.DEFINE_integer("steps", 20, "Timed steps per configuration and round.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "Rounds over all configurations.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 1024, "Examples per replica per step.", lower_bound=1)
    flags.DEFINE_list("replicas", ["1", "2", "4"], "Replica counts, e.g. 1,2.")
    flags.DEFINE_string("only", "", "Only the configurations whose name matches this regular expression.")
    flags.DEFINE_float("accuracy_target", 0.89, "Train gpupar's default to this test accuracy and time it; 0 skips.",
                       lower_bound=0, upper_bound=1)
    flags.DEFINE_integer("accuracy_epochs", 20, "Epochs the accuracy run may take.", lower_bound=1)


def _settings():
    """The flags, checked, as the settings benchmark() takes."""
    try:
        replicas = tuple(sorted({int(r) for r in FLAGS.replicas}))
    except ValueError:
        raise script.UsageError(f"--replicas={','.join(FLAGS.replicas)}: give replica counts like 1,2,4") from None
    if not replicas or min(replicas) < 1:
        raise script.UsageError(f"--replicas={','.join(FLAGS.replicas)}: counts must be at least 1")
    try:
        only = re.compile(FLAGS.only)
    except re.error as e:
        raise script.UsageError(f"--only={FLAGS.only!r} is not a regular expression ({e})") from None
    return Settings(script.data_dir(FLAGS.data_dir), FLAGS.steps, FLAGS.repeats, FLAGS.batch_size, replicas, only,
                    FLAGS.accuracy_target, FLAGS.accuracy_epochs)


@dataclasses.dataclass(frozen=True)
class Settings:
    """One benchmark run's settings (the flags, checked)."""

    data_dir: str
    steps: int
    repeats: int
    batch_size: int
    replicas: Tuple[int, ...]
    only: Any
    accuracy_target: float
    accuracy_epochs: int


def main() -> int:
    """Runs the benchmark, prints the table, writes JSON and the plot."""
    settings = _settings()
    rows = [row for row in configurations(settings.replicas, gpu=_has_gpu()) if settings.only.search(row.name)]
    if not rows:
        raise script.UsageError(f"no configuration matches --only={settings.only.pattern!r}")
    started = time.perf_counter()
    report = benchmark(settings, rows, say=lambda message: print(f"[bench] {message}", flush=True))
    report["seconds"] = time.perf_counter() - started
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    if FLAGS.plot:
        plot(report, FLAGS.plot)
        print(f"wrote {FLAGS.plot}")
    print(f"({report['seconds']:.0f} s)")
    return 0


def _has_gpu() -> bool:
    """Whether NVIDIA's driver lists a GPU, asked without starting TensorFlow in this process."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if __name__ == "__main__":
    script.run("benchmarks.bench", define_flags, main)
