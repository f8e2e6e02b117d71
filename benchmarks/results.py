"""Every table of figures the README and the docs quote, from one run of the current code (make results).

    python -m benchmarks.results                    # about 50 minutes on an idle 2-core machine (make results)
    python -m benchmarks.results --only=train,diagnose
    python -m benchmarks.results --quick            # every benchmark tiny, into runs/results/quick: a smoke test

Runs each benchmark as a process of its own, one after another (run it on an otherwise idle
machine: every figure is a speed), reads the JSON each writes, and writes OUT_DIR/RESULTS.md and
OUT_DIR/RESULTS.json: per table, the git commit (and whether the work tree differed from it), the
exact command, the date, how many cores other processes kept busy just before it (flagged above
0.25: the machine was not idle), the machine (cores, CPU, TensorFlow and Keras versions) and the
table in markdown, ready to paste. A benchmark that fails leaves its table out,
says so, and the command exits with status 1 after the others have run. The tables, in order:

- train: `make train`'s run (the README's Results table), `gpupar --dataset=fashion_mnist
  --epochs=5` from scratch into WORK_DIR/train, about 40 s;
- keras_io: `python -m benchmarks.keras_io`, gpupar.fit against model.fit at its defaults and at
  its best on five keras-io programs, float32 and bfloat16, and their limits, about 30 minutes;
- step_profile: `python -m benchmarks.step_profile`, an op-level profile of model.fit at its best
  and of gpupar.fit at one replica (docs/how-it-works.md), about 1 minute;
- own_step: `python -m benchmarks.own_step`, a GAN's own train_step, about 4 minutes;
- bench: `python -m benchmarks.bench --repeats=3`, the ConvNet against model.fit and the TF1
  tower code, the options, the time to 0.89 accuracy, about 11 minutes;
- input: `python -m benchmarks.input`, augmentation on the host against on the device (docs/input-bound.md),
  about 3 minutes;
- pipeline: `python -m benchmarks.pipeline`, model parallelism (docs/model-parallel.md), about 5 minutes;
- diagnose: `gpupar diagnose --dataset=fashion_mnist --json`, what bounds the preset's training
  and float32 against bfloat16 (docs/input-bound.md), about 1 minute.

Each benchmark's own JSON, its log and the training run stay in --work_dir (runs/results).
"""

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Callable, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import script  # noqa: E402

FLAGS = flags.FLAGS

TABLES = ("train", "keras_io", "step_profile", "own_step", "bench", "input", "pipeline", "diagnose")
OUT_DIR, QUICK_DIR = "benchmarks/results", "runs/results/quick"
BUSY_CORES = 0.25  # cores kept busy by other processes just before a table above this: the machine was not idle


def define_flags():
    """The script's flags."""
    flags.DEFINE_string("data_dir", None, f"Fashion-MNIST IDX folder; empty: {script.DEFAULT_DATA_DIR}.")
    flags.DEFINE_list("only", list(TABLES), f"Which tables, of {', '.join(TABLES)}.")
    flags.DEFINE_string("out_dir", None, f"Write RESULTS.md and RESULTS.json here; empty: {OUT_DIR} ({QUICK_DIR} "
                        "with --quick).")
    flags.DEFINE_string("work_dir", "runs/results", "Each benchmark's JSON and log, and the training run, go here.")
    flags.DEFINE_bool("quick", False, "Every benchmark tiny (its own quick mode, 1-2 steps per epoch): a smoke test "
                      "of a few minutes, whose figures are no results.")


@dataclasses.dataclass(frozen=True)
class Table:
    """One benchmark run and the table it gives.

    Attributes:
      name: One of TABLES.
      title: The table's heading in RESULTS.md.
      quoted_in: Where its figures go (README, benchmarks/README.md, docs).
      command: The command's argv, run from the repository's root.
      output: The JSON file the command writes; None: its standard output ends with the JSON.
      markdown: The table(s) from the JSON report (and the command's standard output: gpupar's log).
    """

    name: str
    title: str
    quoted_in: str
    command: List[str]
    output: Optional[str]
    markdown: Callable[[dict, str], str]


# ---------------------------------------------------------------------------------------------
# Each benchmark's table in markdown.


def train_markdown(report: dict, log: str) -> str:
    """make train's table (as the README's Results): one row per epoch, then its log without the progress lines."""
    lines = ["| epoch | loss | accuracy | val_loss | val_accuracy | seconds | examples/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for record in report["history"]:
        logs = record["logs"]
        lines.append(f"| {record['epoch']} | {logs['loss']:.4f} | {logs['accuracy']:.4f} | {logs['val_loss']:.4f} "
                     f"| {logs['val_accuracy']:.4f} | {record['seconds']:.1f} | {record['examples_per_second']:,.0f} |")
    lines += ["", f"{report['strategy']}; global batch {report['global_batch']}; "
              f"{report['total_seconds']:.1f} s in all.", "", "Its log, without the progress lines:", "", "```"]
    lines += [line for line in log.splitlines() if line.strip() and not PROGRESS.match(line)]
    return "\n".join(lines + ["```"])


PROGRESS = re.compile(r"Epoch:\[\d+\] \[")  # gpupar's progress lines: Epoch:[0] [20 / 59] ...


def diagnose_markdown(report: dict, _log: str) -> str:
    """gpupar diagnose's three rates, its verdict and float32 against the fast format."""
    lines = [f"{report['strategy']}; global batch {report['global_batch']}, {report['steps']} timed steps each", "",
             "| measurement | examples/s |", "| --- | --- |"]
    for text, key in (("input pipeline alone", "input"), ("train step alone (one batch on the devices)", "step"),
                      ("together, as training runs", "together")):
        lines.append(f"| {text} | {report[f'{key}_examples_per_second']:,.0f} |")
    lines += ["", f"Input wait {report['input_wait_fraction']:.0%} of step time; training is bound by the "
              f"{report['bound_by']}."]
    lines += [f"- recommended: {text}" for text in report["recommendations"]]
    if len(report["precisions"]) == 2:
        (_, plain), (fast_name, fast) = report["precisions"].items()
        lines += ["", "| number format | examples/s | mean loss of the same steps |", "| --- | --- | --- |",
                  f"| float32 | {plain['examples_per_second']:,.0f} | {plain['loss']:.4f} |",
                  f"| {fast_name} | {fast['examples_per_second']:,.0f} | {fast['loss']:.4f} |", "",
                  f"{fast_name} at {fast['examples_per_second'] / plain['examples_per_second']:.2f}x float32's rate."]
    lines += [f"- note: {text}" for text in report["notes"]]
    return "\n".join(lines)


def benchmark_markdown(module: str) -> Callable[[dict, str], str]:
    """The markdown of a benchmark whose module's table(report) writes it."""
    def markdown(report: dict, _log: str) -> str:
        import importlib

        return importlib.import_module(f"benchmarks.{module}").table(report)
    return markdown


def tables(data_dir: str, work_dir: str, quick: bool) -> List[Table]:
    """Every table, with its command: the full run's, or the quick one's."""
    python = sys.executable
    train_dir = os.path.join(work_dir, "train")
    tiny = {"train": ["--epochs=1", "--steps_per_epoch=2", "--per_replica_batch_size=64"],
            "keras_io": ["--quick", "--examples=mnist_convnet", "--precisions=float32"],
            "step_profile": ["--examples=mnist_convnet", "--scale=1"],
            "own_step": ["--quick"],
            "bench": ["--replicas=1", "--only=^(gpupar|model.fit)$", "--steps=2", "--repeats=1", "--batch_size=16",
                      "--accuracy_target=0"],
            "input": ["--steps=4", "--repeats=1", "--batch_size=64"],
            "pipeline": ["--steps=2", "--repeats=1", "--batch_size=32", "--lstm_units=16"],
            "diagnose": ["--diagnose_steps=4", "--per_replica_batch_size=64"]}
    full = {"train": ["--epochs=5"], "keras_io": [], "step_profile": [], "own_step": [], "bench": ["--repeats=3"], "input": [],
            "pipeline": [], "diagnose": []}
    extra = tiny if quick else full
    json_of = {name: os.path.join(work_dir, f"{name}.json") for name in TABLES}
    return [
        Table("train", "make train: the ConvNet on Fashion-MNIST", "README.md, Results",
              [python, "-m", "gpupar", "--dataset=fashion_mnist", f"--data_dir={data_dir}", *extra["train"],
               f"--model_dir={train_dir}", f"--log_dir={train_dir}/tensorboard", f"--metrics_json={json_of['train']}"],
              json_of["train"], train_markdown),
        Table("keras_io", "gpupar.fit against model.fit on keras-io programs, float32 and bfloat16",
              "benchmarks/README.md", [python, "-m", "benchmarks.keras_io", *extra["keras_io"],
                                       f"--json={json_of['keras_io']}"],
              json_of["keras_io"], benchmark_markdown("keras_io")),
        Table("step_profile", "Where the time goes at one replica: model.fit at its best and gpupar.fit, op by op",
              "docs/how-it-works.md", [python, "-m", "benchmarks.step_profile", *extra["step_profile"],
                                       f"--json={json_of['step_profile']}"],
              json_of["step_profile"], benchmark_markdown("step_profile")),
        Table("own_step", "A model's own train_step (DCGAN-like)", "benchmarks/README.md",
              [python, "-m", "benchmarks.own_step", *extra["own_step"], f"--json={json_of['own_step']}"],
              json_of["own_step"], benchmark_markdown("own_step")),
        Table("bench", "gpupar against model.fit and the TF1 tower code (the ConvNet)", "benchmarks/README.md",
              [python, "-m", "benchmarks.bench", f"--data_dir={data_dir}", *extra["bench"],
               f"--json={json_of['bench']}", f"--plot={os.path.join(work_dir, 'bench.png')}"],
              json_of["bench"], benchmark_markdown("bench")),
        Table("input", "Augmentation on the host against on the device", "docs/input-bound.md",
              [python, "-m", "benchmarks.input", f"--data_dir={data_dir}", *extra["input"], f"--json={json_of['input']}"],
              json_of["input"], benchmark_markdown("input")),
        Table("pipeline", "Model parallelism: micro-batches and devices", "docs/model-parallel.md",
              [python, "-m", "benchmarks.pipeline", f"--data_dir={data_dir}", *extra["pipeline"],
               f"--json={json_of['pipeline']}"], json_of["pipeline"], benchmark_markdown("pipeline")),
        Table("diagnose", "gpupar diagnose on the preset: what bounds it, float32 against bfloat16",
              "docs/input-bound.md", [python, "-m", "gpupar", "diagnose", "--dataset=fashion_mnist",
                                      f"--data_dir={data_dir}", *extra["diagnose"], "--json"],
              None, diagnose_markdown),
    ]


# ---------------------------------------------------------------------------------------------
# Where and on what a table was made.


def git_state(leave_out=()) -> dict:
    """The commit (short), and whether the work tree differs from it: the changed paths, less `leave_out`."""
    def git(*args):
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=script.ROOT)
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain")
    changed = [line[3:] for line in (status or "").splitlines()
               if not any(line[3:].startswith(path) for path in leave_out)]
    return {"commit": commit.strip() if commit else "unknown (no git)", "dirty": bool(changed), "changed": changed}


def machine() -> dict:
    """This machine: cores, CPU model and its bfloat16 units, GPUs, Python, TensorFlow and Keras (without starting
    TensorFlow here)."""
    cpu, units = "unknown", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "unknown":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not units:
                    units = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in line.split()]
    except OSError:
        pass
    versions = {}
    for package in ("tensorflow", "keras"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    gpus = _gpus()
    return {"cores": len(os.sched_getaffinity(0)), "cpu": cpu, "bfloat16_units": units, "gpus": gpus,
            "python": platform.python_version(), **versions}


def _gpus() -> List[str]:
    """NVIDIA's list of GPUs (nvidia-smi -L), empty where there are none."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def describe(machine_: dict) -> str:
    """The machine in one line."""
    units = f" ({', '.join(u.upper() for u in machine_['bfloat16_units'])})" if machine_["bfloat16_units"] else ""
    gpus = f", {len(machine_['gpus'])} GPU(s)" if machine_["gpus"] else ", no GPU"
    return (f"{machine_['cores']} cores, {machine_['cpu']}{units}{gpus}; Python {machine_['python']}, "
            f"TensorFlow {machine_['tensorflow']}, Keras {machine_['keras']}")


def busy_cores(seconds: float = 2.0) -> Optional[float]:
    """Cores the machine's other processes keep busy, from /proc/stat over `seconds` while this one waits (None
    where it cannot be read)."""
    def times():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # all, idle + iowait

    try:
        (total_before, idle_before), _, (total_after, idle_after) = times(), time.sleep(seconds), times()
    except (OSError, ValueError, IndexError):
        return None
    total = total_after - total_before
    return os.cpu_count() * (1 - (idle_after - idle_before) / total) if total else 0.0


# ---------------------------------------------------------------------------------------------
# Running the tables and writing RESULTS.md.


def run(table: Table, work_dir: str, leave_out) -> dict:
    """Runs one table's command, echoing its output; its entry of RESULTS.json (report, or the failure)."""
    entry = {"name": table.name, "title": table.title, "quoted_in": table.quoted_in,
             "command": shlex.join(table.command), **git_state(leave_out),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "busy_cores_before": busy_cores()}
    print(f"[results] {table.name}: {entry['command']}", flush=True)
    log_path = os.path.join(script.ROOT, work_dir, f"{table.name}.log")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(table.command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=script.ROOT,
                                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        stdout = []
        for line in process.stdout:
            stdout.append(line)
            if table.output is not None:  # a JSON on stdout is not echoed
                print(f"[{table.name}] {line}", end="", flush=True)
        process.wait()
    entry["seconds"] = time.perf_counter() - started
    with open(log_path) as f:
        stderr = f.read()
    try:
        if process.returncode != 0:
            raise ValueError(f"status {process.returncode}")
        if table.output is None:  # gpupar diagnose --json: its JSON on stdout
            report = json.loads("".join(stdout))
        else:
            with open(os.path.join(script.ROOT, table.output)) as f:
                report = json.load(f)
        entry["markdown"] = table.markdown(report, "".join(stdout))
        entry["report"] = report
    except (ValueError, OSError, KeyError) as e:
        entry["failed"] = f"{e}; its standard error is in {log_path}"
        print(f"[results] {table.name} FAILED ({e}); the end of its standard error:\n{stderr[-3000:]}", flush=True)
    return entry


def results_markdown(entries: List[dict], machine_: dict, quick: bool) -> str:
    """RESULTS.md: per table, where it goes, its commit, command, date, machine, and the table."""
    lines = ["# Results", "",
             "Written by `make results` (`python -m benchmarks.results`): every table below is one run of the command "
             "under it, on the commit it names. Paste a table where it is quoted, with its command and commit.", ""]
    if quick:
        lines += ["**--quick: a smoke test of tiny runs; no figure here is a result.**", ""]
    lines += [f"Machine: {describe(machine_)}.", ""]
    for entry in entries:
        dirty = f", with changes not committed ({', '.join(entry['changed'])})" if entry["dirty"] else ""
        busy = entry["busy_cores_before"]
        idle = (f"other processes kept {busy:.2f} cores busy just before it" if busy is not None else "idle unknown")
        if busy is not None and busy > BUSY_CORES:
            idle = f"**{idle}: the machine was not idle, its speeds are no results**"
        lines += [f"## {entry['title']}", "",
                  f"For {entry['quoted_in']}. Commit {entry['commit']}{dirty}; {entry['date']}; "
                  f"{entry['seconds']:.0f} s; {idle}.", "",
                  "```sh", entry["command"], "```", ""]
        lines += [f"**Failed**: {entry['failed']}. No figures." if "failed" in entry else entry["markdown"], ""]
    return "\n".join(lines)


def write(out_dir: str, entries: List[dict], machine_: dict, quick: bool):
    """Writes RESULTS.md and RESULTS.json (again after every table, so that a stopped run keeps what it made)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "RESULTS.md"), "w") as f:
        f.write(results_markdown(entries, machine_, quick))
    with open(os.path.join(out_dir, "RESULTS.json"), "w") as f:
        json.dump({"quick": quick, "machine": machine_, "tables": entries}, f, indent=2)


def main() -> int:
    """Runs the tables asked for, one after another, and writes RESULTS.md and RESULTS.json."""
    unknown = sorted(set(FLAGS.only) - set(TABLES))
    if unknown or not FLAGS.only:
        raise script.UsageError(f"--only={','.join(FLAGS.only)}: choose from {', '.join(TABLES)}")
    data_dir = script.data_dir(FLAGS.data_dir)
    out_dir = FLAGS.out_dir or (QUICK_DIR if FLAGS.quick else OUT_DIR)
    work_dir = FLAGS.work_dir  # the commands run in the repository's root: a relative path is from there
    shutil.rmtree(os.path.join(script.ROOT, work_dir, "train"), ignore_errors=True)  # make train's run from scratch
    os.makedirs(os.path.join(script.ROOT, work_dir), exist_ok=True)
    leave_out = [os.path.relpath(os.path.join(script.ROOT, d), script.ROOT) for d in (out_dir, work_dir)]  # ours
    machine_ = machine()
    entries = []
    for table in tables(os.path.abspath(data_dir), work_dir, FLAGS.quick):
        if table.name in FLAGS.only:
            entries.append(run(table, work_dir, leave_out))
            write(os.path.join(script.ROOT, out_dir), entries, machine_, FLAGS.quick)
    print(f"wrote {os.path.join(out_dir, 'RESULTS.md')} and RESULTS.json")
    failed = [entry["name"] for entry in entries if "failed" in entry]
    if failed:
        print(f"[results] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    script.run("benchmarks.results", define_flags, main)
