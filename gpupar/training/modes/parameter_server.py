"""Asynchronous data parallelism: ParameterServerStrategy with a ClusterCoordinator.

    gpupar launch --workers=2 --ps=1 -- python train.py     # train.py: gpupar.fit(model_fn, dataset_fn, ...)

The chief is the coordinator: it builds the model and its optimizer under `strategy.scope()`,
which places every variable (weights, batch-norm statistics, the optimizer's slots) on the
parameter servers, a variable of 256 KiB or more split into shards over them, then schedules
train steps onto the workers. Each scheduled step runs on one worker: it reads the current
variables, computes the gradients of its own batch and applies them without waiting for any
other worker. Keras 3's `model.fit` does not support this strategy (keras-team/keras#18624),
but its models and optimizers work inside such a custom step. Worker and ps tasks only run a
tf.distribute.Server until they are stopped. The chief evaluates, reading the variables from
the ps tasks.

An epoch is `steps_per_epoch` steps in total, spread over the workers as they free up. The
MNIST presets' workers read their own shard of the seeded batch order (batches w, w+N, ...), so
together they see every batch once per pass; a dataset_fn gives each worker its own pipeline.
"""

import collections
import dataclasses
import logging
import re

import keras
import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.runtime.cluster import Cluster
from gpupar.runtime.devices import configure_devices
from gpupar.runtime.network import warn_if_reachable
from gpupar.runtime.strategy import SHARD_BYTES, detected_plan, max_shards, plan_strategy, shared_strategy
from gpupar.training.inner_loop import Results
from gpupar.training.modes.mode import Mode
from gpupar.training.steps.step import as_logs, keras_logs, train_function
from gpupar.training.trainer import Placement

log = logging.getLogger("gpupar")
IN_FLIGHT_PER_WORKER = 2  # scheduled calls not yet fetched, per worker: enough to keep each busy


def server_settings(task_type: str, devices) -> dict:
    """The ConfigProto fields of a serving task's tf.distribute.Server, from its DevicePlan.

    The Server makes its devices from its own ConfigProto, not from tf.config, so the memory
    settings go there too; a ps task holds variables only and stays off the GPUs.
    """
    settings = {"inter_op_parallelism_threads": 4}
    if task_type == "ps" or not devices.visible_gpus:
        settings["device_count"] = {"GPU": 0}
        return settings
    settings["visible_device_list"] = ",".join(map(str, devices.visible_gpus))
    settings["allow_growth"] = devices.memory_growth
    if devices.memory_limits_mb is not None:
        settings["memory_limits_mb"] = list(devices.memory_limits_mb)
    return settings


def _server_config(settings: dict):
    config = tf.compat.v1.ConfigProto()
    # Each closure the coordinator sends needs an inter-op thread while it waits on the ps tasks;
    # with as few threads as cores (2 here) a worker can stall.
    config.inter_op_parallelism_threads = settings["inter_op_parallelism_threads"]
    for device, count in settings.get("device_count", {}).items():
        config.device_count[device] = count
    if "visible_device_list" in settings:
        config.gpu_options.visible_device_list = settings["visible_device_list"]
        config.gpu_options.allow_growth = settings["allow_growth"]
    for limit in settings.get("memory_limits_mb", ()):
        config.gpu_options.experimental.virtual_devices.add().memory_limit_mb.append(limit)
    return config


def serve(distribution, device_setup, cluster: Cluster):
    """Runs this task's tf.distribute.Server until the process is stopped (it never returns)."""
    plan = plan_strategy(distribution.strategy, [], ["/cpu:0"], cross_device_ops=distribution.cross_device_ops,
                         cluster=cluster)
    devices = configure_devices(device_setup)
    settings = server_settings(cluster.task_type, devices)
    log.info("%s serving on %s until stopped, in %s; GPUs: %s", cluster.task_name,
             cluster.jobs[cluster.task_type][cluster.task_index], plan.describe(),
             settings.get("visible_device_list") or "none")
    warn_if_reachable(cluster.task_name, cluster.jobs[cluster.task_type][cluster.task_index])
    server_config = _server_config(settings)
    server = tf.distribute.Server(
        tf.train.ClusterSpec({job: list(a) for job, a in cluster.jobs.items()}),
        job_name=cluster.task_type, task_index=cluster.task_index, protocol="grpc", config=server_config,
        start=True,
    )
    server.join()


def update_variables(model):
    """The variables the optimizer updates, one per shard of a variable split over the ps tasks.

    Keras' variables can hold a tf.distribute ShardedVariable (the strategy's partitioner made
    it), but Keras can neither differentiate with respect to one nor update it. So each shard
    gets a Keras variable of its own for the optimizer (its slots then sit beside the shard, on
    the shard's ps task), and the model's variable saves and restores as the ShardedVariable
    does: in slices of one tensor, which an unsplit variable restores too.

    Returns:
      (the variables to differentiate and update, one line per split variable for the log).
    """
    updated, split = [], []
    for variable in model.trainable_variables:
        shards = getattr(variable.value, "variables", None)
        if shards is None:
            updated.append(variable)
            continue
        with tf.variable_creator_scope(lambda _next, shard_iter=iter(shards), **_: next(shard_iter)):
            updated += [keras.Variable(initializer="zeros", shape=s.shape, dtype=s.dtype, name=f"{variable.name}_shard{i}")
                        for i, s in enumerate(shards)]
        keras_compat.saved_as_shards(variable)
        split.append(f"{variable.path} {tuple(variable.shape)} in {len(shards)} shards, on "
                     f"{', '.join(_task(s.device) for s in shards)}")
    for model_variable in model.non_trainable_variables:
        if getattr(model_variable.value, "variables", None) is not None:
            keras_compat.saved_as_shards(model_variable)
    return updated, split


def _task(device: str) -> str:
    """'/job:ps/replica:0/task:1/device:CPU:0' -> 'ps:1'."""
    match = re.search(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)", device)
    return f"{match[1]}:{match[2]}" if match else device


def worker_function(step, strategy):
    """train(iterator, num_steps) -> (the step's totals, worker index, the model's metrics): num_steps of the step's
    train steps on one worker.

    Each step is the worker's own: the loss of its batch, differentiated with respect to the
    variables the step updates (update_variables) and applied at once, without waiting for the
    other workers. The model's metrics are read on the worker once its steps have updated them,
    as Keras 2's fit read them under ParameterServerStrategy (its train_function returned them):
    the coordinator reads no variable on the ps tasks while other workers' calls run (an eager
    read from the coordinator then has crashed it, SIGSEGV, under load).
    """
    steps = train_function(step, strategy)

    @tf.function(autograph=False)
    def train(iterator, num_steps):
        totals, _, _ = steps(iterator, num_steps)
        with tf.control_dependencies(tf.nest.flatten(totals)):  # after the steps' metric updates
            metrics = step.model.get_metrics_result()
        return totals, tf.distribute.coordinator.experimental_get_current_worker_index(), metrics

    return train


class Scheduler:
    """The coordinator's side of training: calls of steps scheduled onto the workers as they free up.

    At most IN_FLIGHT_PER_WORKER calls per worker wait unfetched; `schedule` returns the results
    of the calls it had to wait for (so they lag behind what was scheduled), `finish` waits for
    every call still in flight; `metrics` gives the model's metrics as the last fetched call's
    worker read them, until nothing is in flight.
    """

    def __init__(self, coordinator, step, strategy, num_workers: int):
        self.coordinator, self.step, self.train = coordinator, step, worker_function(step, strategy)
        self.max_in_flight = IN_FLIGHT_PER_WORKER * num_workers
        self.pending = collections.deque()
        self.fetched_metrics = None  # as the worker of the last fetched call read them

    def _collect(self) -> Results:
        num_steps, remote = self.pending.popleft()
        totals, worker, metrics = _fetch(self.coordinator, remote)
        self.fetched_metrics = as_logs(metrics)
        results = self.step.results(num_steps, totals, None, None)
        return dataclasses.replace(results, by_worker={int(worker): num_steps})

    def run(self, iterator, num_steps: int, first_call: bool = False) -> Results:
        """Schedules one call of num_steps steps; returns the results of the calls that finished meanwhile."""
        done = Results()
        while len(self.pending) >= self.max_in_flight:  # bounded: wait for the oldest before scheduling more
            done += self._collect()
        with self.step.in_call():  # where the workers' function is traced, on its first schedule
            self.pending.append((num_steps, self.coordinator.schedule(self.train, args=(iterator, num_steps))))
        return done

    def finish(self) -> Results:
        """Waits until every scheduled step has been applied; returns the results not yet returned."""
        self.coordinator.join()
        done = Results()
        while self.pending:
            done += self._collect()
        self.fetched_metrics = None
        return done

    def metrics(self) -> dict:
        """The model's metrics: read here once nothing is in flight, else as the last fetched call's worker read them."""
        if not self.pending:
            return keras_logs(self.step.model)
        return self.fetched_metrics or {}  # {} only before the epoch's first call is fetched: no steps to log


def _fetch(coordinator, remote):
    """remote.fetch() of a scheduled step, also when the step's worker fails meanwhile.

    TF marks a step's RemoteValue ready once the step's call has returned on the coordinator,
    when its outputs may still be the worker's to produce; the worker's thread then copies them
    to the coordinator under its failure handling, which schedules the step again if the worker
    died. A fetch() from here can take that copy over first, and then raises the dead worker's
    error (UnavailableError: Socket closed) itself, outside that handling, although TF re-runs
    the step. join() waits until every scheduled step has finished, re-runs included, and raises
    the error of a step that really failed; the step's outputs are then on the coordinator and
    the second fetch() returns them.
    """
    try:
        return remote.fetch()
    except tf.errors.OpError as e:
        log.warning("a step's worker failed while its result was fetched (%s); waiting for the re-run",
                    type(e).__name__)
        coordinator.join()
        return remote.fetch()


class ParameterServer(Mode):
    """strategy=parameter_server (or auto in a cluster with ps tasks): workers that update on their own."""

    name = "parameter_server"
    strategies = ("parameter_server",)
    options = {"ps_shards": "splits variables over the ps tasks of"}
    refused_loop_options = {"profile_steps": "it saves after each epoch and on a signal",
                            "checkpoint_every_steps": "it saves after each epoch and on a signal"}
    batch_norm = "updates asynchronously"
    steps_per_call = 1  # unless told otherwise, a call per step: an epoch spreads evenly over the workers

    @classmethod
    def selected(cls, distribution, cluster) -> bool:
        return distribution.strategy in cls.strategies or (cluster is not None and bool(cluster.num_ps))

    def refuse_task(self, task):
        if not task.train.per_worker:
            raise GpuparError(f"strategy=parameter_server needs x as a dataset_fn(input_context), not "
                              f"{task.train.form}: each worker makes its own input pipeline with it (arrays or a "
                              "dataset made here would be copied into every worker's graph)")

    def serves(self, cluster) -> bool:
        return cluster is not None and cluster.task_type != "chief"

    def serve(self, device_setup, cluster):
        serve(self.distribution, device_setup, cluster)

    def place(self, device_setup, cluster) -> Placement:
        distribution = self.distribution
        plan = detected_plan(distribution.strategy, distribution.devices, distribution.cross_device_ops,
                             cluster=cluster)
        strategy = shared_strategy(plan, distribution.ps_shards)
        shards = max_shards(plan.cluster.num_ps, distribution.ps_shards)
        log.info("variables: on %d ps task(s); %s", plan.cluster.num_ps,
                 f"those of {SHARD_BYTES // 1024} KiB or more split into up to {shards} shards" if shards > 1
                 else "each one whole")
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        # Each step trains one worker's batch, on its own: one replica per update.
        return Placement(plan.describe(), strategy, plan.num_replicas, plan.devices, workers=plan.num_workers, plan=plan)

    def jit_refusal(self, placement):
        return "jit_compile: gpupar runs a parameter-server worker's steps without XLA"

    def updated_variables(self, model):
        return update_variables(model)

    def calls(self, step, placement, replica_rows):
        return Scheduler(self.coordinator, step, placement.strategy, placement.workers)

    def make_input(self, train, placement, global_batch):
        strategy, workers = placement.strategy, placement.workers

        def make(first_step, limit=None):
            if train.per_replica_batches and first_step:
                log.info("resume: each worker's pipeline skips %d batches, its share of the %d steps already trained "
                         "(which worker trained which is not recorded)", first_step // workers, first_step)

            def worker_dataset(context):
                return train.worker_batches(context, global_batch, first_step, limit, workers)

            return iter(self.coordinator.create_per_worker_dataset(
                tf.function(lambda: strategy.distribute_datasets_from_function(worker_dataset))))

        return make

    def make_evaluate(self, step, data, placement, eval_batch, validation_steps, steps_per_call):
        if data is not None:
            log.info("evaluation: on the chief, reading the variables from the ps tasks")
        return super().make_evaluate(step, data, placement, eval_batch, validation_steps, steps_per_call)
