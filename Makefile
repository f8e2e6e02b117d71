# make train: set up, then the default training run.   make test: set up, then every test.
VENV ?= .venv
PYTHON ?= python3
DATA_DIR ?= /usr/share/datasets/fashion-mnist
RUN_DIR ?= runs/fashion_mnist
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: venv data train test test-fast bench bench-input bench-pipeline bench-keras-io bench-own-step results docs clean

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

train: venv data
	$(VENV)/bin/gpupar --dataset=fashion_mnist --data_dir=$(DATA_DIR) --epochs=5 \
		--model_dir=$(RUN_DIR) --resume --log_dir=$(RUN_DIR)/tensorboard \
		--metrics_json=$(RUN_DIR)/metrics.json

# Three pytest workers on 2 cores: under two, the many tests that wait on subprocesses (kills,
# restarts, clusters starting) leave a core idle; worksteal evens out the few long tests.
PYTEST := $(VENV)/bin/python -m pytest -q -n 3 --dist worksteal

test: venv data
	$(PYTEST)

test-fast: venv data
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
