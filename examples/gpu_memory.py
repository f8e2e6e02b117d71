"""GPU memory: memory growth, a fixed limit, or a fraction of each GPU.

    python examples/gpu_memory.py            # TF1: GPUOptions(allow_growth=True) and friends
    python examples/gpu_memory.py --quick

The decision (plan_devices) is a pure function of the GPU list, so this example shows what each
setting does on a 2-GPU machine with 16 GiB GPUs even where there is none; then it applies
memory growth to this machine's real GPUs (or says they are ignored).
"""

import gpupar

two_gpus = dict(num_gpus=2, gpu_memory_mb=[16384, 16384])
print("allow_growth=True          ->", gpupar.plan_devices(**two_gpus, memory_growth=True))
print("a 4096 MiB limit per GPU   ->", gpupar.plan_devices(**two_gpus, memory_limit_mb=4096).memory_limits_mb)
print("memory fraction 0.4        ->", gpupar.plan_devices(**two_gpus, memory_fraction=0.4).memory_limits_mb)
print("only GPU 1 (CUDA_VISIBLE_DEVICES=1) ->", gpupar.plan_devices(**two_gpus, gpus=[1]).visible_gpus)

# On this machine: the same call that fit_mnist makes, before any other TensorFlow work.
plan = gpupar.configure_devices(gpupar.Config(memory_growth=True))
print("this machine:", plan.ignored or f"memory growth on for GPUs {plan.visible_gpus}")
