"""Keras' own trainer and callback tests, run through gpupar.fit: the peer suite of gpupar's claim to be model.fit.

The tests are those of the installed Keras's source distribution (`make keras-tests` downloads
it into .keras-tests/, git-ignored): keras/src/trainers/trainer_test.py and
keras/src/callbacks/*_test.py. Each runs three ways, one test module each:

    test_on_keras.py       Keras' own model.fit (the control: it must pass, and train as keras_passes.txt says)
    test_one_replica.py    keras.Model.fit replaced by gpupar.fit(model, ...) on one device
    test_two_replicas.py   the same on two replicas (mirrored, two of the session's virtual CPUs)

Only fit is replaced; evaluate and predict stay Keras'. The tests that count are those in
keras_passes.txt: they pass on Keras here and fit a keras.Model (the others are not collected). A
gpupar.fit that applies no update where Keras' fit did (in the same call of the same test) fails
the test, even if its assertions pass. Deliberate differences are differences.py's, strict xfails.

    make keras-own              the three runs (pytest -n 2), and a summary of the counts
    make test                   the two gpupar.fit runs (the control is keras_passes.txt's, pinned Keras)
    make keras-own-baseline     runs every test on Keras alone and rewrites keras_passes.txt

What the harness itself adds, for Keras and gpupar alike: the session's 4 virtual CPUs and its
temporary working folder (tests/conftest.py); one random seed set before each test (Keras' own
run seeds nothing; here a test whose outcome depends on its initial weights has one outcome); a
stand-in for jax, which trainer_test.py imports at the top but only its jax-backend tests use;
Keras' root conftest's skip_if_backend, which remote_monitor_test.py imports and the source
distribution lacks; Keras' conftest's rule that multi_device tests skip on TensorFlow; and
TensorFlow's context kept as the session made it (harness.keep_devices: one test resets it).
Optional packages that are not installed (orbax, scipy, jax, torch, grain) leave the tests that
need them failing or skipped on Keras, so out of the count. Run directly by Keras' pytest (with
its conftest and a jax stand-in), the same 217 of these files' 265 tests pass as in this harness.
"""
