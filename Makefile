# make train: set up, then the default training run.   make test: set up, then every test.
# make test-versions: set up each TensorFlow + Keras pair of VERSION_PAIRS, then the user-facing tests on it.
VENV ?= .venv
PYTHON ?= python3
DATA_DIR ?= /usr/share/datasets/fashion-mnist
RUN_DIR ?= runs/fashion_mnist
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: venv venv-versions data keras-tests keras-own keras-own-baseline train test test-fast test-versions bench \
	bench-input bench-pipeline bench-keras-io bench-own-step results docs clean

# The TensorFlow + Keras pairs that CI tests (make test-versions), oldest first, all inside the range that
# pyproject.toml admits: Colab's 2.18 + 3.8 and 2.19 + 3.10, 2.20 + 3.12, and the newest, which is .venv's.
VERSION_PAIRS := 2.18.0:3.8.0 2.19.0:3.10.0 2.20.0:3.12.0 2.21.0:3.15.1
NEWEST_PAIR := $(lastword $(VERSION_PAIRS))
pins = tensorflow==$(firstword $(subst :, ,$(1))) keras==$(lastword $(subst :, ,$(1)))
tf_minor = $(basename $(firstword $(subst :, ,$(1))))
OLDER_MINORS := $(foreach pair,$(filter-out $(NEWEST_PAIR),$(VERSION_PAIRS)),$(call tf_minor,$(pair)))
# Each pair's environment, the project installed editable in it: .venv-tf2.18/ (make venv-tf2.18) and so on;
# the newest pair's is .venv, the one make train and make test use.
PAIR_VENVS := $(foreach minor,$(OLDER_MINORS),.venv-tf$(minor)) $(VENV)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]' $(call pins,$(NEWEST_PAIR))
	touch $@

venv: $(VENV)/.installed

.venv-tf%/.installed: pyproject.toml
	$(if $(filter $*.%,$(VERSION_PAIRS)),,$(error no pair of VERSION_PAIRS has TensorFlow $*))
	$(PYTHON) -m venv .venv-tf$*
	.venv-tf$*/bin/pip install -q -e '.[test]' $(call pins,$(filter $*.%,$(VERSION_PAIRS)))
	touch $@

$(foreach minor,$(OLDER_MINORS),venv-tf$(minor)): venv-tf%: .venv-tf%/.installed
venv-tf$(call tf_minor,$(NEWEST_PAIR)): venv
venv-versions: $(foreach minor,$(OLDER_MINORS),venv-tf$(minor)) venv

# Real Fashion-MNIST in MNIST's IDX format, from Debian (MNIST itself needs a download).
$(DATA_DIR)/train-images-idx3-ubyte.gz:
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq dataset-fashion-mnist

data: $(DATA_DIR)/train-images-idx3-ubyte.gz

# Keras' own trainer and callback tests, from the source distribution of the installed Keras (not kept in the
# repository): tests/keras_own runs them through gpupar.fit. Downloaded once per Keras version.
KERAS_TESTS := .keras-tests
KERAS_VERSION = $$($(VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("keras"))')

keras-tests: venv
	@version=$(KERAS_VERSION) && folder=$(KERAS_TESTS)/keras-$$version && \
	if [ ! -f $$folder/.complete ]; then \
		rm -rf $$folder $(KERAS_TESTS)/download && \
		$(VENV)/bin/pip download -q --no-deps --no-binary :all: -d $(KERAS_TESTS)/download keras==$$version && \
		tar -xzf $(KERAS_TESTS)/download/keras-$$version.tar.gz -C $(KERAS_TESTS) --wildcards \
			"keras-$$version/keras/src/trainers/trainer_test.py" "keras-$$version/keras/src/callbacks/*_test.py" && \
		rm -rf $(KERAS_TESTS)/download && touch $$folder/.complete; \
	fi

# The peer suite alone: Keras' tests on Keras' fit, then through gpupar.fit on 1 and 2 replicas, with the counts.
keras-own: venv keras-tests
	$(VENV)/bin/python -m pytest -q -n 2 tests/keras_own

# Rewrites tests/keras_own/keras_passes.txt: every Keras test on Keras alone, and the fits of those that pass.
keras-own-baseline: venv keras-tests
	KERAS_OWN_BASELINE=tests/keras_own/keras_passes.txt $(VENV)/bin/python -m pytest -q -n 2 \
		tests/keras_own/test_on_keras.py || [ $$? = 1 ]

train: venv data
	$(VENV)/bin/gpupar --dataset=fashion_mnist --data_dir=$(DATA_DIR) --epochs=5 \
		--model_dir=$(RUN_DIR) --resume --log_dir=$(RUN_DIR)/tensorboard \
		--metrics_json=$(RUN_DIR)/metrics.json

# Three pytest workers on 2 cores: under two, the many tests that wait on subprocesses (kills,
# restarts, clusters starting) leave a core idle; worksteal evens out the few long tests. Keras' own tests on
# Keras' own fit (the control of tests/keras_own, 62 fits of Keras alone) run in make keras-own, not here: the
# installed Keras is pinned, and keras_passes.txt holds what its control run gave.
PYTEST := $(VENV)/bin/python -m pytest -q -n 3 --dist worksteal --ignore=tests/keras_own/test_on_keras.py

test: venv data keras-tests
	$(PYTEST)

test-fast: venv data keras-tests
	$(PYTEST) -m "not slow"

# What a user's program does (gpupar.fit and model.fit's surface), not slow: the tests that must pass on every pair.
USER_TESTS := tests/test_fit.py tests/test_front_door.py tests/test_keras_native.py tests/test_own_step.py \
	tests/test_keras_surface.py tests/test_fit_options.py

# Every pair, each named in the log with what its environment holds, even after a pair fails; fails if any did.
# Two workers: these tests compute, they do not wait on subprocesses.
test-versions: data
	@failed=""; for venv in $(PAIR_VENVS); do \
		start=$$(date +%s); \
		$(MAKE) --no-print-directory $$venv/.installed || { failed="$$failed $$venv(install)"; continue; }; \
		$$venv/bin/python -c "from importlib.metadata import version as v; print('=== tensorflow', v('tensorflow'), \
			'+ keras', v('keras'), 'in $$venv (ml_dtypes', v('ml_dtypes') + ', numpy', v('numpy') + ', protobuf', \
			v('protobuf') + '; set up in $$(( $$(date +%s) - start )) s): the user-facing tests, not slow')"; \
		start=$$(date +%s); \
		$$venv/bin/python -m pytest -q -n 2 -m "not slow" $(USER_TESTS) || failed="$$failed $$venv"; \
		echo "=== $$venv: tests took $$(( $$(date +%s) - start )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "=== failed in:$$failed"; exit 1; fi; \
	echo "=== the user-facing tests passed on every pair: $(VERSION_PAIRS)"

bench: venv data
	$(VENV)/bin/python -m benchmarks.bench --data_dir=$(DATA_DIR)

bench-input: venv data
	$(VENV)/bin/python -m benchmarks.input --data_dir=$(DATA_DIR)

bench-pipeline: venv data
	$(VENV)/bin/python -m benchmarks.pipeline --data_dir=$(DATA_DIR)

bench-keras-io: venv
	$(VENV)/bin/python -m benchmarks.keras_io

bench-own-step: venv
	$(VENV)/bin/python -m benchmarks.own_step

# Every table the README and the docs quote, one benchmark after another, into benchmarks/results/RESULTS.md with
# each table's commit, command, date and machine: about an hour, on an otherwise idle machine.
results: venv data
	$(VENV)/bin/python -m benchmarks.results --data_dir=$(DATA_DIR)

# docs/flags.md is generated from Config's field docstrings; a test checks that it is current.
docs: venv
	$(VENV)/bin/python -c 'import gpupar.cli; print(gpupar.cli.flags_markdown(), end="")' > docs/flags.md

clean:
	rm -rf $(VENV) .venv-tf* runs .pytest_cache
