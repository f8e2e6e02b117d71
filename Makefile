# make train: set up, then the default training run.   make test: set up, then every test.
VENV ?= .venv
PYTHON ?= python3
DATA_DIR ?= /usr/share/datasets/fashion-mnist
RUN_DIR ?= runs/fashion_mnist
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: venv data keras-tests keras-own keras-own-baseline train test test-fast bench bench-input bench-pipeline bench-keras-io bench-own-step results docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

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
# restarts, clusters starting) leave a core idle; worksteal evens out the few long tests.
PYTEST := $(VENV)/bin/python -m pytest -q -n 3 --dist worksteal

test: venv data keras-tests
	$(PYTEST)

test-fast: venv data keras-tests
	$(PYTEST) -m "not slow"

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
# each table's commit, command, date and machine: about 50 minutes, on an otherwise idle machine.
results: venv data
	$(VENV)/bin/python -m benchmarks.results --data_dir=$(DATA_DIR)

# docs/flags.md is generated from Config's field docstrings; a test checks that it is current.
docs: venv
	$(VENV)/bin/python -c 'import gpupar.cli; print(gpupar.cli.flags_markdown(), end="")' > docs/flags.md

clean:
	rm -rf $(VENV) runs .pytest_cache
