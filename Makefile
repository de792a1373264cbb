# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo gpu-check test test-long test-all test-gpu-stack test-distributed test-other-cpu test-torch-2.11 test-torch-2.14 test-torch-2.15 coverage bench bench-train bench-ckpt bench-kernels bench-moe bench-long-context bench-offload lint docs clean

$(STAMP): pyproject.toml tools/cpu_torchvision.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 CPU is pinned here: it installs from local disk; an unpinned torch pulls a CUDA build.
	# torchvision is pinned beside it, in the same resolve: the dev extra leaves it unpinned,
	# since each torch release has its own torchvision (see test-torch-%).
	$(PY) -m pip install --quiet torch==2.13.0 'torchvision==0.28.*' -e '.[dev]'
	# The registry's torchvision (dev extra) is a CUDA build; see tools/cpu_torchvision.py.
	$(call install_torchvision_hook,$(PY))
	touch $(STAMP)

# $(call install_torchvision_hook,python): tools/cpu_torchvision.py's import hook in that venv.
define install_torchvision_hook
cp tools/cpu_torchvision.py "$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_zerojax_cpu_torchvision.py"
echo "import _zerojax_cpu_torchvision; _zerojax_cpu_torchvision.install_hook()" > "$$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_zerojax_cpu_torchvision.pth"
endef

demo: $(STAMP)
	$(PY) examples/train_gpt2.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15

# The end-to-end tests left out of `make test` for time (marked `long`: the real scripts of
# tests/third_party, restarts in fresh processes, the CLI's plans, subprocess jobs). CI runs it
# after `make test`.
test-long: $(STAMP)
	$(PY) -m pytest -q -n 2 -m 'long and not slow' --durations=15

# Every test, slow ones included (all OpInfo samples, the bigger models).
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 -m '' --durations=15

# The multi-process tests left out of `make test` (torchrun jobs on 127.0.0.1: ZeRO-1/2/3 vs
# torch DDP, checkpoints across process counts, SIGKILLed ranks and restarts, the HF Trainer,
# accelerate and Lightning with 2 processes) and the slow integration tests (Lightning, TRL, the
# examples run as scripts); each job has its own timeout. CI runs it after `make test`.
test-distributed: $(STAMP)
	$(PY) -m pytest -q -m slow tests/distributed tests/integrations --durations=10

# The default suite on another torch, each in its own venv (.venv-torch-2.11, ...) with the dev
# extra and the torchvision of that release. torch 2.11.0 is the oldest admitted, what GPU images
# hold (+cu130): a 2.4 GB download from the registry (its CUDA libraries included; about 2
# minutes here); CI runs it beside jax 0.11 instead (test-gpu-stack). torch 2.14.1 (a CUDA build; it runs on CPU)
# lies on local disk and CI runs `make test-torch-2.14`; torch 2.15 is a multi-GB download from the
# registry past this machine's pip constraint (torch<=2.14.1; PIP_CONSTRAINT=/dev/null lifts it
# for that one install), so it is not in CI. No torchvision is made for 2.15 yet: pip takes the
# newest that admits it (0.29.2, built for 2.14; tools/cpu_torchvision.py covers its extension
# failing to load).
TORCH_2.11 := torch==2.11.0 'torchvision==0.26.*'
TORCH_2.14 := torch==2.14.1 torchvision==0.29.1
TORCH_2.15 := 'torch==2.15.*' torchvision
PIP_ENV_2.15 := PIP_CONSTRAINT=/dev/null
TORCH_RELEASES := 2.11 2.14 2.15
$(TORCH_RELEASES:%=.venv-torch-%/.installed): .venv-torch-%/.installed: pyproject.toml tools/cpu_torchvision.py
	test -x .venv-torch-$*/bin/python || $(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --upgrade pip
	$(PIP_ENV_$*) .venv-torch-$*/bin/python -m pip install --quiet $(TORCH_$*) -e '.[dev]'
	# A no-op where torchvision's extension loads (2.14.1 beside 0.29.1); scripts the tests
	# launch import transformers, hence torchvision, without tests/conftest.py.
	$(call install_torchvision_hook,.venv-torch-$*/bin/python)
	touch $@

$(TORCH_RELEASES:%=test-torch-%): test-torch-%: .venv-torch-%/.installed
	.venv-torch-$*/bin/python -m pytest -q -n 2 --durations=15

# The default suite on the stack of a typical GPU image, run on this CPU: Python 3.12, torch
# 2.11.0, jax 0.11.2 (the newest jax; it needs Python >= 3.12, which pyenv holds here). The
# venv is .venv-gpu-stack (a 2.4 GB torch download, about 2 minutes); CI runs it.
PYTHON_3.12 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_STACK := torch==2.11.0 'torchvision==0.26.*' 'jax==0.11.*' 'jaxlib==0.11.*'
.venv-gpu-stack/.installed: pyproject.toml tools/cpu_torchvision.py
	test -x .venv-gpu-stack/bin/python || $(PYTHON_3.12) -m venv .venv-gpu-stack
	.venv-gpu-stack/bin/python -m pip install --quiet --upgrade pip
	.venv-gpu-stack/bin/python -m pip install --quiet $(GPU_STACK) -e '.[dev]'
	$(call install_torchvision_hook,.venv-gpu-stack/bin/python)
	touch $@

test-gpu-stack: .venv-gpu-stack/.installed
	.venv-gpu-stack/bin/python -m pytest -q -n 2 -m 'not slow' --durations=15

# The default suite as another x86-64 CPU computes it, to catch tolerances fitted to this one:
# XLA codegen capped at OTHER_CPU_ISA (AVX2 is an AMD EPYC / pre-AVX-512 Intel; SSE4_2 is
# older), torch's vectorized ATen kernels at ATEN_CPU_CAPABILITY, and torch without oneDNN
# (its bf16 kernels need AVX512-BF16; elsewhere ATen's own kernels round differently).
OTHER_CPU_ISA ?= AVX2
test-other-cpu: $(STAMP)
	XLA_FLAGS="$(XLA_FLAGS) --xla_cpu_max_isa=$(OTHER_CPU_ISA)" ATEN_CPU_CAPABILITY=$(if $(filter SSE4_2,$(OTHER_CPU_ISA)),default,avx2) \
		$(PY) -m pytest -q -n 2 --torch-without-onednn --durations=15

# Coverage matrix over torchvision, timm, Hugging Face and multimodal models (hours on 2 cores;
# resumable: results are cached per model in .cache/model_coverage). Writes the table into
# docs/coverage.md (committed: `make docs` cannot rerun hours of models, so it builds the page
# as committed).
COVERAGE_ARGS ?= --jobs 2
coverage: $(STAMP)
	$(PY) -m tools.model_coverage $(COVERAGE_ARGS) --write-docs

# Peers (torch2jax, torchax) live in their own venv, never in zerojax's dependencies;
# --no-deps keeps them from replacing the pinned torch.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	-$(BENCH_VENV)/bin/python -m pip install --quiet --no-deps torch2jax torchax
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/bridge.py

# Train step (forward + backward + AdamW): zerojax vs PyTorch eager / torch.compile, fp32 and bf16,
# then the step's matmul floor (its products alone, XLA:CPU vs torch) against the targets.
bench-train: $(STAMP)
	$(PY) bench/train_step.py
	$(PY) bench/train_step_floor.py --precision fp32
	$(PY) bench/train_step_floor.py --precision bf16

bench-ckpt: $(STAMP)
	$(PY) bench/checkpoint.py

bench-kernels: $(STAMP)
	$(PY) bench/kernels.py

# Expert parallel vs replicated experts on 8 simulated CPU devices; flat vs hierarchical bytes.
bench-moe: $(STAMP)
	$(PY) bench/moe.py

# ZeRO-3 vs ZeRO-3 + sequence parallelism: longest sequence per device budget, step time.
bench-long-context: $(STAMP)
	$(PY) bench/long_context.py --plot bench/long_context.png

# Host offload: 13B on one device planned with and without it; largest model per budget; CPU step cost.
bench-offload: $(STAMP)
	$(PY) bench/offload.py

# The docs site: the docs extra (mkdocs, material, mkdocstrings) into .venv, the configuration
# reference generated from zerojax/config/schema.py, `mkdocs build --strict` into site/, then
# every code block of the pages run (tests/test_docs.py, its slow tests included).
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(PY) -m tools.config_reference
	$(PY) -m tools.benchmark_table
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	$(PY) -m pytest -q -n 2 -p no:cacheprovider -m '' tests/test_docs.py

# The GPU check (tools/gpu_check): kernels, the GPT-2 train step against torch eager,
# torch.compile and hand-written JAX, planned vs measured memory, host offload, checkpoints;
# a report in GPU_CHECK_OUT. On a GPU machine it runs from this source tree with the machine's
# own python3, torch and jax, installing nothing (docs/benchmarks.md). `make gpu-check CPU=1`
# runs the same code paths on this CPU, tiny and with the Pallas kernels interpreted (CI).
GPU_CHECK_OUT ?= gpu_check_report
ifeq ($(CPU),1)
gpu-check: $(STAMP)
	$(PY) -m tools.gpu_check --cpu --out $(GPU_CHECK_OUT)
else
gpu-check:
	PYTHONPATH=. python3 -m tools.gpu_check --out $(GPU_CHECK_OUT)
endif

# ruff with the rule set in pyproject.toml, the formatter's check, mypy over the public API.
lint: $(STAMP)
	$(VENV)/bin/ruff check zerojax tests bench tools examples
	$(VENV)/bin/ruff format --check zerojax tests bench tools examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(BENCH_VENV) .venv-torch-* .venv-gpu-stack build *.egg-info site docs/configuration.md
