"""Starting TensorFlow without its C++ start-up lines, unless they are asked for.

TensorFlow 2.21 prints a dozen lines as it loads and finds its devices (CUDA stubs, cuInit,
oneDNN, CPU features) before gpupar's own, some of them before its logging is set up, where
TF_CPP_MIN_LOG_LEVEL cannot hide them. The gpupar command sets TF_CPP_MIN_LOG_LEVEL=2 (no INFO
or WARNING lines) unless it is set already, and keeps what TensorFlow writes to stderr while it
starts in a file that it shows only when the start fails, or when the lines are asked for
(absl's --verbosity, or TF_CPP_MIN_LOG_LEVEL=0 or 1).

Two of those lines come later, when training starts: "Memory patch applied" and "Input of
GeneratorDatasetOp::Dataset will not be optimized". gpupar builds no generator dataset:
tf.distribute does, whenever an iterator of experimental_distribute_dataset is made. Its
per-device prefetcher (MultiDeviceIterator) wraps each device's share of the batches in a
small GeneratorDataset that feeds prefetch(1) on the device; its next() is graph ops only (no
Python per batch), and "not optimized" concerns that wrapper, not gpupar's pipeline.
"""

import contextlib
import os
import re
import sys
import tempfile
from typing import MutableMapping, Sequence

# TensorFlow's C++ log lines: "I0000 00:00:1796461724.173709    2055 port.cc:153] ...".
_CPP_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\] ")
# What TensorFlow writes as it starts without a GPU, errors included (there is no GPU to find).
_START_UP_ERRORS = ("cuInit", "Unable to register", "cuda_platform", "cuda_dnn", "cuda_fft", "cuda_blas")
_START_UP_TEXT = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
                  "To enable the following instructions:")


def wants_start_up_lines(argv: Sequence[str], environ: MutableMapping[str, str]) -> bool:
    """Whether the user asked to see TensorFlow's lines; if not, sets TF_CPP_MIN_LOG_LEVEL=2 unless set."""
    asked = any(a.startswith(("--verbosity", "-v=", "--v=")) or a == "-v" for a in argv) or \
        environ.get("TF_CPP_MIN_LOG_LEVEL") in ("0", "1")
    if not asked:
        environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return asked


@contextlib.contextmanager
def _stderr_held():
    """Sends file descriptor 2 to a temporary file; on an exception, writes what it caught to stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def start_up_line(line: str) -> bool:
    """Whether a line of a task's output is TensorFlow's C++ chatter: an INFO or WARNING line, or a start-up error.

    gpupar launch leaves these out of what it relays from a launched script, as the gpupar
    command hides them from its own output; a real error line of TensorFlow's is kept.
    """
    if line.startswith(_START_UP_TEXT):
        return True
    found = _CPP_LINE.match(line)
    return bool(found) and (found.group(1) in "IW" or any(word in line for word in _START_UP_ERRORS))


def start_tensorflow(show_lines: bool):
    """Imports TensorFlow and lets it find its devices, its start-up lines hidden unless `show_lines`."""
    with contextlib.nullcontext() if show_lines else _stderr_held():
        import tensorflow as tf

        tf.config.list_physical_devices()
