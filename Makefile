# Two commands do all the set-up from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STORE ?= $(CURDIR)/.demo-store

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

# Warm a store with the example prompts on the built-in demo model (their shared system prompt is
# computed once), generate from a warmed prompt (all reused), then generate a new prompt twice
# (the second run reuses the first), and show what is stored.
demo: install
	$(VENV)/bin/kvstore warm --store $(STORE) --prompts examples/prompts.jsonl
	head -n 1 examples/prompts.jsonl | $(VENV)/bin/kvstore generate --store $(STORE) --max-tokens 16 --prompts -
	$(VENV)/bin/kvstore generate --store $(STORE) --max-tokens 16 \
		--prompt "You are a helpful assistant. Answer briefly. What is a KV cache?"
	$(VENV)/bin/kvstore generate --store $(STORE) --max-tokens 16 \
		--prompt "You are a helpful assistant. Answer briefly. What is a KV cache?"
	$(VENV)/bin/kvstore stats --store $(STORE)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .demo-store .pytest_cache .hypothesis
