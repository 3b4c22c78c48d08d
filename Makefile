# `make demo` and `make test` work on a fresh clone: they create .venv and install everything.
# torch goes in first, pinned; the rest installs under constraints.txt so pip never swaps in
# a newer torch (which would pull several GB of CUDA wheels).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): requirements.txt constraints.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -r requirements.txt
	$(BIN)/pip install --quiet -c constraints.txt -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit demo

# pytest exits 5 when it collects no tests: treat that as the failure it is.
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=15 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) runs
