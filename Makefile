# lstmgrad: the two commands a new user needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: demo test test-fast lint bench bench-batch bench-stream bench-lengths fuzz signals fixtures conformance docs clean \
	gpu-check gpu-pylibs bench-gpu

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	@rm -f /tmp/lstmgrad-demo.grads.h5
	$(VENV)/bin/lstmgrad seq fixtures/demo.h5 --group lstm -o /tmp/lstmgrad-demo.grads.h5 --force

test: $(STAMP)
	$(PY) -m pytest

# The quick loop while developing: every module, less the tests marked slow (real worker batches, signals, Dask
# clusters, bombs, the longer fuzz); under a minute on two idle cores. `make test` runs them too.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

# docs/commands.md from the commands' --help (tests/test_docs.py fails when it drifts).
docs: $(STAMP)
	$(PY) docs/make_commands.py > docs/commands.md

lint: $(STAMP)
	$(VENV)/bin/ruff check lstmgrad_cli tests benchmarks

bench: $(STAMP)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) benchmarks/bench_backends.py $(BENCH_ARGS)

# A batch of small files as users run it (serial, --workers 2) against the in-process floor, per BLAS library
# (BENCH_ARGS="--format hdf5": HDF5 files in and out).
bench-batch: $(STAMP)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) benchmarks/bench_batch.py $(BENCH_ARGS)

# A streamed 2.6 GB HDF5 sequence against the in-memory compute of the same tensors, with peak memory.
bench-stream: $(STAMP)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) benchmarks/out_of_core.py $(BENCH_ARGS)

# An nn.LSTM's gradient with per-example lengths against the padded one, lstmgrad and PyTorch (.venv-torch) side by side.
bench-lengths: $(STAMP)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) benchmarks/bench_lengths.py $(BENCH_ARGS)

# On a machine with a CUDA GPU, from the repository root with the machine's own Python (the device tool's machines
# have cupy, torch, h5py, click and rich, no venv and no network): backends --check, the gpu tests, every golden
# case on cupy and the bench against cuDNN, in under 5 minutes (benchmarks/gpu_check.py).  GPU_CHECK_ARGS="--budget
# SECONDS" bounds the whole run (400 s by default).
gpu-check:
	PYTHONPATH="$(CURDIR):$(CURDIR)/build/gpu-pylibs" $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Issue 39's table on a CUDA GPU, with the machine's own Python: cuDNN's backward (TF32 off and on), lstmgrad on
# device arrays (both time loops), from host arrays, file to file and its reading and writing alone, the PCIe floor
# and the GPU's GEMM limit, for its six shapes, one process, engines alternating.
GPU_SHAPES := 50,32,128,128 100,64,256,256 200,128,512,512 100,256,1024,1024 500,16,256,256 1000,64,512,512
bench-gpu:
	PYTHONPATH="$(CURDIR)" $(PYTHON) -m lstmgrad_cli bench --backend cupy --repeats 5 --markdown \
		$(foreach shape,$(GPU_SHAPES),--shape $(shape))

# pytest and hypothesis for such a machine, to carry with the working tree (build/ is not committed).
gpu-pylibs:
	$(PYTHON) -m pip install --quiet --target build/gpu-pylibs pytest hypothesis

# The long fuzz run (hypothesis); `make test` runs a short one. LSTMGRAD_FUZZ_EXAMPLES sets the examples per test.
fuzz: $(STAMP)
	LSTMGRAD_FUZZ_EXAMPLES=$${LSTMGRAD_FUZZ_EXAMPLES:-20000} $(PY) -m pytest -p no:cacheprovider tests/test_fuzz.py \
		tests/test_hostile_files.py tests/test_tfdbg_hostile.py tests/test_hostile_safetensors.py \
		tests/test_hostile_models.py --hypothesis-show-statistics -q

# Ctrl-C, SIGTERM and SIGKILL at random moments of real batches, 50 rounds per case (`make test` runs two).
signals: $(STAMP)
	LSTMGRAD_SIGNAL_ROUNDS=$${LSTMGRAD_SIGNAL_ROUNDS:-50} $(PY) -m pytest -p no:cacheprovider tests/test_signals.py -q

# TensorFlow-computed cases kept outside this repository, in ../shared/conformance (CONFORMANCE=DIR to point
# elsewhere); the repository's own TF golden files are fixtures/, which `make test` checks.
CONFORMANCE ?= ../shared/conformance
conformance: $(STAMP)
	@test -f "$(CONFORMANCE)/check" || { echo "make conformance needs the shared TensorFlow conformance cases at" \
		"$(CONFORMANCE) (a checkout of the team's shared folder beside this one, or CONFORMANCE=DIR);" \
		"fixtures/ and make test cover the same ops without them." >&2; exit 2; }
	LSTMGRAD="$(VENV)/bin/lstmgrad" $(PY) $(CONFORMANCE)/check

# Golden files from real TensorFlow, Keras and PyTorch (dev only, their own virtualenvs; tests never need them).
fixtures:
	$(PYTHON) -m venv .venv-tf
	.venv-tf/bin/pip install --quiet -r fixtures/requirements-tf.txt
	.venv-tf/bin/python fixtures/make_fixtures.py
	.venv-tf/bin/python fixtures/make_tfdbg_fixtures.py
	.venv-tf/bin/python fixtures/make_keras_fixtures.py
	$(PYTHON) -m venv .venv-tfkeras
	.venv-tfkeras/bin/pip install --quiet -r fixtures/requirements-tfkeras.txt
	.venv-tfkeras/bin/python fixtures/make_keras2_fixtures.py
	$(PYTHON) -m venv .venv-torch
	.venv-torch/bin/pip install --quiet -r fixtures/requirements-torch.txt
	.venv-torch/bin/python fixtures/make_torch_fixtures.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist
