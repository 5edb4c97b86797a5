# qtool developer tasks. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   := out/demo
LOCK   := requirements.lock
LATEST := .venv-latest
QUARK  := .venv-quark

.PHONY: demo install dev test test-fast test-latest lock lint bench quark-env golden samples clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python  ## create .venv and install qtool into it, at the locked versions
	$(BIN)/pip install --quiet -c $(LOCK) -e .
	$(BIN)/python -m compileall -q qtool  # an editable install is not byte-compiled as pip compiles a wheel's files

dev: $(BIN)/python  ## install qtool with the dev extras, at the locked versions
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[dev]"
	$(BIN)/python -m compileall -q qtool

demo: install  ## calibrate + quantize the sample CNN, then print the comparison report
	@mkdir -p $(DEMO)
	$(BIN)/qtool calibrate sample_models/cnn/model.onnx sample_models/cnn/calib -o $(DEMO)/cnn.stats.json
	$(BIN)/qtool quantize sample_models/cnn/model.onnx --stats $(DEMO)/cnn.stats.json --search-data sample_models/cnn/calib -o $(DEMO)/cnn.int8.onnx
	$(BIN)/qtool compare sample_models/cnn/model.onnx $(DEMO)/cnn.int8.onnx --data sample_models/cnn/eval

test: dev  ## run the whole test suite (dependencies from requirements.lock)
	$(BIN)/python -m pytest -q

test-fast: dev  ## the suite without the tests marked slow (a few seconds each; the full suite is make test)
	$(BIN)/python -m pytest -q -m "not slow"

test-latest:  ## the suite on the newest release of every dependency, in .venv-latest (not run by CI)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/pip install --quiet --upgrade --upgrade-strategy eager -e ".[dev]"
	$(LATEST)/bin/pip list --format freeze | grep -iE '^(onnx|onnxruntime|numpy|typer|rich|pyyaml|pillow)=='
	$(LATEST)/bin/python -m pytest -q

lock: dev  ## re-resolve requirements.lock from pyproject.toml's ranges (uv pip compile, newest compatible)
	$(BIN)/uv pip compile pyproject.toml --extra dev --universal --python-version 3.10 \
		--upgrade --custom-compile-command "make lock" --quiet -o $(LOCK)

lint: dev  ## ruff + mypy
	$(BIN)/ruff check qtool tests bench
	$(BIN)/ruff format --check qtool tests bench
	$(BIN)/mypy

bench: $(BIN)/python $(QUARK)/installed  ## qtool vs onnxruntime and AMD Quark: default's cost, quantizer, all-integer algorithms, transformers, decoders, calibrators, Dask workers, observers, a streaming VAD closed-loop, 1 GiB model, 2 GiB decoder
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[bench]"
	$(BIN)/python -m compileall -q qtool
	$(BIN)/python bench/cost.py
	$(BIN)/python bench/run.py
	QTOOL_QUARK_PYTHON=$(QUARK)/bin/python $(BIN)/python bench/peers_integer.py
	$(BIN)/python bench/algorithms.py
	$(BIN)/python bench/transformers.py
	$(BIN)/python bench/decoders.py
	$(BIN)/python bench/calibration.py
	$(BIN)/python bench/scaleout.py
	$(BIN)/python bench/tune.py
	$(BIN)/python bench/stateful.py
	$(BIN)/python bench/observers.py
	$(BIN)/python bench/large_model.py
	$(BIN)/python bench/large_decoder.py --skip-calibrated

# AMD Quark (a benchmark peer, bench/peers_integer.py) pins onnx and onnxruntime below qtool's and
# imports torch without declaring it, so it gets its own environment. torch: the CPU-only build
# where pip can find one (a local wheel or an index given in PIP_EXTRA_INDEX_URL/PIP_FIND_LINKS);
# otherwise the default PyPI build with its CUDA libraries (several GB, still runs on CPU).
quark-env: $(QUARK)/installed  ## AMD Quark + CPU torch in .venv-quark, for bench/peers_integer.py

$(QUARK)/installed:
	$(PYTHON) -m venv $(QUARK)
	$(QUARK)/bin/python -m pip install --quiet --upgrade pip
	$(QUARK)/bin/pip install --quiet "torch==2.13.0+cpu" || $(QUARK)/bin/pip install --quiet "torch==2.13.0"
	$(QUARK)/bin/pip install --quiet "amd-quark==0.13" "onnx==1.22.0" "onnxruntime==1.28.0"
	$(QUARK)/bin/python -c "import torch, quark.onnx; print('torch', torch.__version__, '/ amd-quark', quark.__version__)"
	touch $@

golden: dev  ## rewrite tests/golden/*.json from the current code (review the diff like code)
	QTOOL_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/golden

samples: $(BIN)/python  ## regenerate sample_models/ (seeded; trains the sample decoder, about 15 CPU minutes)
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[samples]"
	$(BIN)/python sample_models/generate.py

clean:
	rm -rf $(VENV) $(LATEST) $(QUARK) out build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
