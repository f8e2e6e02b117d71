"""Started in every Python subprocess of a test (conftest puts this folder on PYTHONPATH).

Keras imports pandas and matplotlib.pyplot at its own import when they are installed, for
DataFrame inputs and its image galleries. Both are test extras here, not gpupar's dependencies,
and they cost about 1.2 of the 4 CPU-seconds that every process here takes to import TensorFlow:
most of the suite's subprocesses (cluster tasks, restarts, examples, benchmark runs) are that.
So Keras' own imports of them find nothing, as after `pip install gpupar`; anything else that
imports them (gpupar plot, the benchmarks' plots) gets them.
"""

import sys

_KERAS_OPTIONAL = ("pandas", "matplotlib")


def _in(module, packages):
    """Whether `module` is one of `packages` or inside one (keras.src.x is in keras; keras_io is not)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


class _NotForKeras:
    """A meta path finder that refuses Keras, and only Keras, the two optional packages."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if not _in(name, _KERAS_OPTIONAL):
            return None
        frame = sys._getframe(1)
        while frame is not None and _in(frame.f_globals.get("__name__", ""), ("importlib", "_frozen_importlib",
                                                                              "_frozen_importlib_external")):
            frame = frame.f_back  # the import system's own frames, up to the importing module
        if frame is not None and _in(frame.f_globals.get("__name__", ""), ("keras",)):
            raise ModuleNotFoundError(f"No module named {name!r} (left out of Keras' import in tests)", name=name)
        return None


sys.meta_path.insert(0, _NotForKeras)
