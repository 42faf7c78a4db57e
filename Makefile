# Two commands do all the set-up from a fresh clone: `make demo` and `make test`.
# mlx-lm 0.32 and obstore need Python 3.11 or newer: the first such python3 on PATH, unless given
# (`make test PYTHON=/path/to/python3.12`).
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.11; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STORE ?= $(CURDIR)/.demo-store
comma := ,

.PHONY: install bytecode demo test bench clean

$(VENV)/.installed: pyproject.toml
	@$(or $(PYTHON),false) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
		echo "kvstore needs Python 3.11 or newer (mlx-lm 0.32 does):" \
		     "$(if $(PYTHON),$(PYTHON) is $$($(PYTHON) -V 2>/dev/null || echo not a Python that runs),none of python3$(comma) python3.13$(comma) python3.12$(comma) python3.11 on PATH is);" \
		     "run make $(MAKECMDGOALS) PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

# kvstore's own bytecode, compiled where it changed: with PYTHONDONTWRITEBYTECODE set (as on some
# machines) every process would compile the modules it imports again (0.17 s of CPU each, and the
# test suite starts about 400 processes).
bytecode: install
	@$(PY) -m compileall -q kvstore tests bench

# Warm a store with the example prompts on the built-in demo model (their shared system prompt is
# computed once), generate from a warmed prompt (all reused), then generate a new prompt twice
# (the second run reuses the first), and show what is stored.
demo: bytecode
	$(VENV)/bin/kvstore warm --store $(STORE) --prompts examples/prompts.jsonl
	head -n 1 examples/prompts.jsonl | $(VENV)/bin/kvstore generate --store $(STORE) --max-tokens 16 --prompts -
	$(VENV)/bin/kvstore generate --store $(STORE) --max-tokens 16 \
		--prompt "You are a helpful assistant. Answer briefly. What is a KV cache?"
	$(VENV)/bin/kvstore generate --store $(STORE) --max-tokens 16 \
		--prompt "You are a helpful assistant. Answer briefly. What is a KV cache?"
	$(VENV)/bin/kvstore stats --store $(STORE)

# Two pytest-xdist workers, one per core of the 2-core machines the suite runs on (an idle one takes
# tests queued for the other: the slowest tests do not end up in one tail); every fixture
# works per worker (its own temporary folders, demo models and SeaweedFS).
test: bytecode
	$(PY) -m pytest -q -n 2 --dist worksteal

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .demo-store .pytest_cache .hypothesis
