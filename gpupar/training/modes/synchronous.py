"""Synchronous data parallelism: every tf.distribute strategy but parameter servers.

Every replica steps together on its share of the global batch; the gradients are all-reduced in
the optimizer's update (gpupar.training.step). One machine's devices (one_device, mirrored,
central_storage) or a cluster's workers in lock step (multi_worker_mirrored).
"""

import logging

from gpupar.errors import GpuparError
from gpupar.runtime.strategy import build_strategy, detected_plan, jit_compile_refusal
from gpupar.training.engine import Placement, no_evaluation
from gpupar.training.inner_loop import timed_loop_iterations
from gpupar.training.modes.mode import Mode, own_step_calls, timed_calls
from gpupar.training.own_step import FirstStepCheck, make_own_evaluation, make_own_train_function, probe
from gpupar.training.step import make_evaluate_function, make_evaluation, make_train_function

log = logging.getLogger("gpupar")


class Synchronous(Mode):
    """Replicas that step together: the default mode."""

    name = "synchronous"
    takes_own_step = True

    def selected(self, distribution, cluster) -> bool:
        return True  # asked last: whatever no other mode takes

    def refuse_task(self, task, config):
        accumulate = config.step.accumulate_steps
        if task.train.own_batches and accumulate > 1:
            raise GpuparError(f"accumulate_steps={accumulate} makes each replica's batch {accumulate} times larger, and "
                              f"{task.train.form}'s batches are its own: give arrays or an unbatched dataset, or make "
                              "its batches larger and use accumulate_steps=1")

    def place(self, config, cluster) -> Placement:
        distribution = config.distribution
        plan = detected_plan(distribution.strategy, distribution.devices, distribution.cross_device_ops,
                             max_cpus=config.device_setup.virtual_cpus or 1, cluster=cluster)
        strategy = build_strategy(plan)  # a multi-worker strategy must come before any other TensorFlow work
        workers = plan.cluster.num_workers if plan.kind == "multi_worker_mirrored" else 1
        return Placement(plan.describe(), strategy, plan.num_replicas, plan.num_replicas, plan.devices,
                         input_pipelines=workers, lockstep_workers=cluster is not None, plan=plan)

    def build(self, prepared):
        placement, step, optimizer = prepared.placement, prepared.step, prepared.update_optimizer
        strategy, skips = placement.strategy, step.nan_policy == "skip"
        refusal = jit_compile_refusal(placement.plan) if step.jit_compile else None
        if refusal:
            log.info(refusal)
        jit_compile, iterations = step.jit_compile and not refusal, timed_loop_iterations(placement.on_gpus)
        per_pipeline = placement.replicas // placement.input_pipelines

        def make_input(first_step, limit=None):
            return iter(prepared.train.distribute(strategy, prepared.global_batch, first_step, limit, per_pipeline))

        evaluation = None
        if prepared.evaluation is not None:
            evaluation = prepared.evaluation.distribute_evaluation(
                strategy, prepared.eval_batch, per_pipeline, prepared.input.validation_steps)
        if prepared.own_step:
            return self._build_own_step(prepared, make_input, evaluation, jit_compile, iterations, per_pipeline)
        train_function = make_train_function(strategy, prepared.model, optimizer, prepared.objective, skips,
                                             prepared.train.device_transform, jit_compile, step.accumulate_steps,
                                             iterations)
        evaluate = no_evaluation
        if evaluation is not None:
            dataset, steps = evaluation
            evaluate = make_evaluation(make_evaluate_function(strategy, prepared.model, prepared.objective),
                                       iter(dataset), steps, prepared.objective, prepared.model)
        return prepared.engine(make_input, timed_calls(train_function, optimizer.dynamic_scale if skips else None),
                               evaluate)

    @staticmethod
    def _build_own_step(prepared, make_input, evaluation, jit_compile, iterations, per_pipeline):
        """The Engine of a model with its own train_step (gpupar.training.own_step), traced before any restore."""
        strategy, model = prepared.placement.strategy, prepared.model
        spec = prepared.train.distribute(strategy, prepared.global_batch, 0, None, per_pipeline).element_spec
        train_function = make_own_train_function(strategy, model, probe(strategy, model, spec), jit_compile,
                                                 iterations)
        evaluate = no_evaluation
        if evaluation is not None:
            dataset, steps = evaluation
            names = probe(strategy, model, dataset.element_spec, "test_step")
            evaluate = make_own_evaluation(strategy, model, iter(dataset), steps, names)
        return prepared.engine(make_input, own_step_calls(train_function, FirstStepCheck(model)), evaluate)
