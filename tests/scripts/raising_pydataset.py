"""A PyDataset whose worker processes raise, trained again and again: `python raising_pydataset.py RUNS`.

Each run must end with gpupar's one line naming the batch, raised from the user's error, whose
traceback (from the worker process) shows the user's __getitem__, and leave no worker process
running. It prints, per run, the seconds it took, the child processes still running, the line,
and the last line of the user's traceback that names the script.
"""

import multiprocessing
import sys
import time
import traceback

import keras
import numpy as np

import gpupar


class Unreadable(keras.utils.PyDataset):
    """Batches of 32 images (32x32x3, flattened) by index; batch 5 raises.

    A batch of images (384 KiB) takes a worker several writes to send back, so a fit often stops
    its workers while one of them is sending a batch.
    """

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 32

    def __getitem__(self, index):
        if index == 5:
            raise OSError(f"image {index} is unreadable")
        return self.x[index * 32:(index + 1) * 32], self.y[index * 32:(index + 1) * 32]


def model_fn():
    model = keras.Sequential([keras.Input((3072,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


rng = np.random.default_rng(0)
x, y = rng.normal(size=(512, 3072)).astype("float32"), rng.integers(0, 4, 512).astype("int32")
for run in range(int(sys.argv[1])):
    started = time.perf_counter()
    try:
        gpupar.fit(model_fn, Unreadable(x, y, workers=2, use_multiprocessing=True), epochs=1, save=False, verbose=0)
    except gpupar.GpuparError as e:
        printed = "".join(traceback.format_exception(e))
        user_line = [line for line in printed.splitlines() if "raising_pydataset.py" in line and "__getitem__" in line]
        running = len(multiprocessing.active_children())  # its worker processes, if any were left
        user_frame = user_line[-1].strip() if user_line else None
        print(f"run {run}: {time.perf_counter() - started:.1f} s: {running} running: {e} | {user_frame}", flush=True)
