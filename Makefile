# Two commands do everything on a fresh machine with Python 3.11:
#   make book   builds the site into _build/html, re-executing every notebook
#   make test   runs every test: labs (pytest), notebooks (nbval), and the book build with -W
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: book test test-labs test-notebooks test-book env clean

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run make PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/python -c "import torch, myst_nb, nbval" # fail here, not later, if the install did not finish
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . --all -W -n --keep-going
	@echo "site: $(CURDIR)/_build/html/index.html"

NBVAL := $(BIN)/python -m pytest --nbval notebooks --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider -q

# Labs first (fast failures), then every notebook re-executed and compared with its committed
# outputs, twice: with this CPU's own vectorised kernels and with ATEN_CPU_CAPABILITY=default
# (no vectorisation), so the rounding of another machine is always exercised (notebooks state
# floats only to the precision they assert, see labs/report.py). Then the site is built from
# the verified outputs with warnings as errors.
test: $(STAMP)
	$(BIN)/python -m pytest tests -q
	$(NBVAL)
	ATEN_CPU_CAPABILITY=default $(NBVAL)
	$(BIN)/python tools/build_book.py --no-execute

clean:
	rm -rf _build
