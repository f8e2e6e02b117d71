"""Synchronous data parallelism: every tf.distribute strategy but parameter servers.

Every replica steps together on its share of the global batch; the gradients are all-reduced in
the optimizer's update (gpupar.training.steps.compiled). One machine's devices (one_device,
mirrored, central_storage) or a cluster's workers in lock step (multi_worker_mirrored).
"""

from gpupar.runtime.strategy import STRATEGIES, detected_plan, jit_compile_refusal, shared_strategy
from gpupar.training.inner_loop import timed_loop_iterations
from gpupar.training.modes.mode import Mode
from gpupar.training.steps.step import Evaluation, LocalCalls, no_evaluation
from gpupar.training.trainer import Placement


MULTI_DEVICE = ("mirrored", "central_storage")  # the one-machine kinds of several replicas


class Synchronous(Mode):
    """Replicas that step together: the default mode."""

    name = "synchronous"
    strategies = tuple(s for s in STRATEGIES if s != "parameter_server")
    takes_step_options = True
    replicas_step_together = True
    diagnosable = True

    @classmethod
    def selected(cls, distribution, cluster) -> bool:
        return True  # asked last: whatever no other mode takes

    def place(self, device_setup, cluster) -> Placement:
        distribution = self.distribution
        # Without virtual_cpus, a kind that asks for several devices takes every logical CPU the script
        # configured itself (tf.config.set_logical_device_configuration); auto takes the first alone.
        several = distribution.strategy in MULTI_DEVICE and device_setup.virtual_cpus is None
        plan = detected_plan(distribution.strategy, distribution.devices, distribution.cross_device_ops,
                             max_cpus=None if several else device_setup.virtual_cpus or 1, cluster=cluster)
        strategy = shared_strategy(plan)  # a multi-worker strategy must come before any other TensorFlow work
        return Placement(plan.describe(), strategy, plan.num_replicas, plan.devices, input_pipelines=plan.num_workers,
                         lockstep_workers=cluster is not None, plan=plan)

    def jit_refusal(self, placement):
        return jit_compile_refusal(placement.plan)

    def calls(self, step, placement, replica_rows):
        return LocalCalls(step, placement.strategy, timed_loop_iterations(placement.on_gpus), replica_rows)

    def make_input(self, train, placement, global_batch):
        def make(first_step, limit=None):
            return iter(train.distribute(placement.strategy, global_batch, first_step, limit, _per_pipeline(placement)))
        return make

    def make_evaluate(self, step, data, placement, eval_batch, validation_steps, steps_per_call):
        if data is None:
            return no_evaluation
        dataset, steps = data.distribute_validation(placement.strategy, eval_batch, _per_pipeline(placement),
                                                    validation_steps)
        return Evaluation(step, placement.strategy, iter(dataset), steps, steps_per_call)


def _per_pipeline(placement) -> int:
    """Replicas that one input pipeline feeds: all of them, or one worker's in a cluster."""
    return placement.replicas // placement.input_pipelines
