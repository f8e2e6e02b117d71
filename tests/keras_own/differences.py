"""Where gpupar.fit differs from Keras' model.fit on purpose: the Keras tests of keras_passes.txt it need not pass.

Each entry maps Keras' test id (as keras_passes.txt writes it) to a one-line reason; the test
runs as a strict xfail: it must fail through gpupar.fit, and a pass is reported, so the entry can
go. A plain id applies at 1 and 2 replicas; (id, replicas) at that count only. An id that is not
in keras_passes.txt is an error.
"""

DIFFERENCES = {
    # "trainer_test.TestTrainer::test_example": "why gpupar.fit does otherwise, on purpose",
    # ("trainer_test.TestTrainer::test_example", 2): "why, on 2 replicas only",
}
