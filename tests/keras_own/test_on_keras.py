"""Keras' own trainer and callback tests on Keras' own model.fit: the control of the gpupar runs (see keras_own)."""

from keras_own.harness import run_classes

globals().update(run_classes("keras"))
