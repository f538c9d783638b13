SHELL := /bin/bash
# fusedamp — the two commands a new user needs:
#   make demo   trains real models with fusedamp and torch.amp side by side, prints and plots
#   make test   installs what is missing, builds, runs every C++ and Python test
# Both install their own dependencies and are quick when everything is already built.
PYTHON ?= python3
BUILD  ?= build/dev
JOBS   ?= $(shell nproc)
CMAKE_ARGS ?=
# CUDA architectures of this build when the machine has no GPU and neither TORCH_CUDA_ARCH_LIST
# nor CMAKE_CUDA_ARCHITECTURES names any: the kernels cannot run here, the build only compiles
# them (and CI reads ptxas's register report), and each architecture is a full device compile.
# A machine with a GPU builds for its GPUs; pip builds the release list.
CUDA_ARCH_LIST_WITHOUT_GPU ?= 9.0

.PHONY: all deps build demo test test-cpp test-python cpp-example consumer clean

all: build

deps:
	@PYTHON=$(PYTHON) scripts/ensure_deps.sh

# Configure once, then incremental builds; the library, _C, headers and the CMake package are
# installed into python/fusedamp, which is what `import fusedamp` (PYTHONPATH=python) loads.
build: deps
	@if [ ! -f $(BUILD)/CMakeCache.txt ]; then \
	  cmake -S . -B $(BUILD) -G Ninja -DFUSEDAMP_BUILD_TESTS=ON \
	    -DPython3_EXECUTABLE=$$(command -v $(PYTHON)) \
	    -DCMAKE_INSTALL_PREFIX=$(CURDIR)/python/fusedamp \
	    -DFUSEDAMP_CUDA_ARCH_LIST_WITHOUT_GPU="$(CUDA_ARCH_LIST_WITHOUT_GPU)" $(CMAKE_ARGS); fi
	cmake --build $(BUILD) -j $(JOBS) 2>&1 | tee $(BUILD)/build.log | grep -v "^ptxas info"; exit $${PIPESTATUS[0]}
	cmake --install $(BUILD) > /dev/null

demo: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) examples/python/demo.py --out demo_output

test: build test-cpp test-python consumer

test-cpp:
	ctest --test-dir $(BUILD) --output-on-failure

# One pytest worker per core (pytest-xdist), each on one OpenMP thread: the tests' tensors are
# small, so a second thread costs more than it saves, and two workers' OpenMP teams on two cores
# wait on each other (2-core Xeon, 2026-12-06: 2 min 11 s, against 2 min 40 s in one process on
# one thread and 4 min 7 s on torch's default two). test_thread_count.py sets its own thread
# counts: the multi-threaded kernels are checked there, bit for bit against one thread.
# Each file's tests on one worker (--dist loadfile): a module's fixture that launches ranks
# (test_zero, test_fsdp_checkpoint, ...) then runs once, not once per worker (same machine,
# back to back: 2 min 18 s against 2 min 38 s).
PYTEST_WORKERS ?= $(JOBS)
test-python:
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR)/python $(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) \
	  --dist loadfile tests/python

# The C++ example and the packaging check, each a separate CMake project built against the
# installed package (find_package(fusedamp)). PREFIX: where to install it.
PREFIX ?= $(CURDIR)/python/fusedamp

cpp-example: build
	cmake --install $(BUILD) --prefix $(PREFIX) > /dev/null
	cmake -S examples/cpp -B $(BUILD)/example -G Ninja -DCMAKE_PREFIX_PATH=$(PREFIX)
	cmake --build $(BUILD)/example -j $(JOBS)
	$(BUILD)/example/train_mlp

consumer: build
	cmake --install $(BUILD) --prefix $(PREFIX) > /dev/null
	cmake -S tests/consumer -B $(BUILD)/consumer -G Ninja -DCMAKE_PREFIX_PATH=$(PREFIX)
	cmake --build $(BUILD)/consumer -j $(JOBS)
	$(BUILD)/consumer/consumer

clean:
	rm -rf build python/fusedamp/lib python/fusedamp/include python/fusedamp/share python/fusedamp/_C*.so

# Times one whole mixed-precision step after backward() (overflow check and unscale, optional
# clipping, optimizer update, loss-scale update), fusedamp against torch.amp:
# benchmarks/results/step_<device>.{md,json,png}. Run it on an otherwise idle machine: OpenMP
# timings (torch's and ours) collapse when another process shares the cores. BENCH_ARGS passes
# options, e.g. BENCH_ARGS="--device cuda".
.PHONY: bench-step
bench-step: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/bench_step.py --device cpu $(BENCH_ARGS)

# Host cost per tensor of the ops and of a whole step (many one-element tensors, so dispatch,
# checks and the Python boundary are what is timed), against torch's counterparts:
# benchmarks/results/host_overhead_<device>.{md,json}.
.PHONY: bench-host
bench-host: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/bench_host_overhead.py $(BENCH_ARGS)

# Training steps of real models (resnet18, GPT-2's architecture, the demo's two models) under
# FP32, torch.amp and fusedamp, FP16 and BF16: benchmarks/results/train_<device>.{md,json}.
.PHONY: bench-train
bench-train: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/bench_train.py $(BENCH_ARGS)

# The loss-scale policies (torch's rule and amax) side by side on the demo's models:
# benchmarks/results/scale_policy_<device>.*; and the measurement behind the amax policy's default target: results/amax_margin.*.
.PHONY: bench-scale-policy bench-amax-margin
bench-scale-policy: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/bench_scale_policy.py $(BENCH_ARGS)

bench-amax-margin: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/amax_margin.py $(BENCH_ARGS)

# Master-weight modes: step time, bytes and accuracy of every master_weights / state_dtype
# against torch's plain BF16 fused AdamW, torch-optimi (Kahan) and torchao (stochastic
# rounding), when installed: benchmarks/results/master_modes_<device>.*; and
# "split" against master_weights=True on the demo models: results/split_identity_cpu.*.
.PHONY: bench-master-modes bench-split-identity
bench-master-modes: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/bench_master_modes.py --all $(BENCH_ARGS)

bench-split-identity: build
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/split_identity.py $(BENCH_ARGS)
