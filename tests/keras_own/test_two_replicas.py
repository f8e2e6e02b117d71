"""Keras' own trainer and callback tests with keras.Model.fit replaced by gpupar.fit on 2 replicas (see keras_own)."""

from keras_own.harness import run_classes

globals().update(run_classes(2))
