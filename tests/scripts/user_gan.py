"""A GAN with its own train_step (tests/test_own_step.py's), as `gpupar launch -- python tests/scripts/user_gan.py ...` runs it.

    python user_gan.py MODEL_DIR EPOCHS

Multi-worker mirrored: every worker runs the model's own step on its replica. It prints its
final weights' sum, which must be the same on every worker.
"""

import os
import sys

import numpy as np

import gpupar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_own_step import _images, gan_fn  # noqa: E402

model_dir, epochs = sys.argv[1], int(sys.argv[2])
result = gpupar.fit(gan_fn, _images(), batch_size=32, epochs=epochs, strategy="multi_worker_mirrored",
                    model_dir=model_dir, resume=True)
weights = sum(float(np.sum(w)) for w in result.model.get_weights())
print(f"user_gan done: {result.replicas} replicas, d_loss {result.logs['d_loss']:.4f}, weights {weights:.6f}")
