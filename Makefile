# Two commands do everything on a fresh machine with Python 3.11:
#   make book   builds the site into _build/html, re-executing every notebook
#   make test   runs every test: labs (pytest), notebooks (nbval), the book build with -W, and
#               the browser check of every page (headless Chromium, network blocked)
# and `make lab` opens the notebooks in JupyterLab.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# On Linux without an NVIDIA GPU (no nvidia-smi), torch comes from PyTorch's CPU wheel index: the
# default index's Linux torch is the CUDA build, gigabytes of GPU libraries a laptop never uses.
# Only torch itself is looked up there (the pin of requirements.txt, whose CPU wheel 2.13.0+cpu
# ranks above the plain one); its dependencies and the rest come from the default index.
# TORCH_INDEX= keeps the default index alone.
TORCH_INDEX ?= $(if $(and $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,cpu)),--extra-index-url https://download.pytorch.org/whl/cpu)

.PHONY: book test test-numerics lab test-labs test-notebooks test-book check-site chromium npm env clean box-test box-wheels \
	box-lab gpu-check test-devices

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run make PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/pip install -q --no-deps $(TORCH_INDEX) "$$(grep -m1 '^torch==' requirements.txt)" 2>&1 | grep -v "is ignored: it is neither" || true)
	$(BIN)/pip install -q -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/python -c "import torch, myst_nb, nbval, playwright" # fail here, not later, if the install did not finish
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Debian's chromium for the browser check (tools/check_site.py): installed with apt-get when it is
# missing and we are root; otherwise one sentence says what to run. Nothing downloads a browser.
chromium:
	@if [ -n "$$CHROMIUM" ] || command -v chromium >/dev/null || [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium for the browser check (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
	  || { echo "error: apt-get could not install chromium, which the browser check needs; install it by hand (apt-get install chromium) or set CHROMIUM=/path/to/chromium"; exit 1; }; \
	else echo "error: the browser check needs Chromium: run 'sudo apt-get install chromium' (Debian/Ubuntu) or set CHROMIUM=/path/to/chromium"; exit 1; fi

# npm fetches the site calculators' Pyodide once (tools/pyodide_dist.py, into .cache/pyodide): Debian's
# npm is installed with apt-get when it is missing and we are root; otherwise one sentence says what to run.
npm:
	@if ls .cache/pyodide/pyodide-*.tgz >/dev/null 2>&1 || command -v npm >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing npm for the site's calculators (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null \
	  || { echo "error: apt-get could not install npm, which fetches the calculators' Pyodide; install it by hand (apt-get install npm)"; exit 1; }; \
	else echo "error: the site's calculators need Pyodide from npm: run 'sudo apt-get install npm' (Debian/Ubuntu)"; exit 1; fi

book: $(STAMP) npm
	$(BIN)/jupyter-book build . --all -W -n --keep-going
	@echo "site: $(CURDIR)/_build/html/index.html"

NBVAL := $(BIN)/python -m pytest --nbval notebooks --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider -q --durations=12

# The lab tests two at a time (pytest-xdist, each file whole on one worker): run one at a time they
# leave a core idle most of the time, their ranks waiting on one another and on deadlines (a hung
# rank's watchdog, a killed replica's restart), and a second worker fills it: three minutes less.
# Tests marked `timed` compare times (a pipelined run against its serialised twin, a thread's CPU
# time): beside another worker on 2 cores they failed on a slow hour, so they run alone after the pair.
# The float-sensitive tests (marked `numerics`) time nothing, so they run paired too (2:58 alone, 2:09
# paired on this machine). The notebooks run one at a time: paired, they took as long (each keeps both cores busy), and the
# ones that time something would measure their neighbour too.
PAIR := -n 2 --dist loadfile

# Another CPU's rounding on this one: ATen's scalar kernels instead of the vectorised ones,
# oneMKL's most portable code path (its matrix products block and sum in another order) and
# oneDNN held to SSE4.1. tests/test_numerics.py checks that these settings change the rounding.
OTHER_CPU := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41

# Labs first (fast failures), the float-sensitive lab tests (marked `numerics`) under OTHER_CPU only,
# then every notebook re-executed under OTHER_CPU and compared with its committed
# outputs (notebooks state floats only to the precision they assert, see labs/measure/report.py).
# The outputs were recorded with this CPU's own kernels, so the one forced pass checks both that
# nothing drifted and that no output depends on the rounding; a second, native pass would repeat
# the recording run and cost a fifth of the time budget (`make test-numerics` and `make book` run
# the notebooks natively). The same holds for the `numerics` tests: each exact comparison and bound is
# derived to hold on any CPU, another CPU's rounding is the harder case, and the native pass of them
# (`make test-numerics`) would cost two more minutes of the budget.
# Then the site is built from the verified outputs with warnings as errors, and every page is
# opened in headless Chromium with the network blocked (tools/check_site.py), at 1280 px and at a
# phone's 390 px, code cells wider than their column and figures too small to read at 390 px
# included (--enforce). Before all of it, ruff (seconds): pyflakes and 110 columns in labs/, tools/
# and tests/, and the notebooks formatted to their 88 columns (notebooks/ruff.toml). Chromium is
# checked first, so a machine without it fails in seconds, not after the notebooks.
test: $(STAMP) chromium npm
	$(BIN)/ruff check labs tools tests notebooks
	$(BIN)/ruff format --check notebooks
	$(BIN)/python -m pytest tests -q --durations=15 -m "not numerics and not timed" $(PAIR)
	$(BIN)/python -m pytest tests -q -m "timed and not numerics"
	$(OTHER_CPU) $(BIN)/python -m pytest tests -q -m numerics $(PAIR)
	$(OTHER_CPU) $(NBVAL)
	$(BIN)/python tools/build_book.py --no-execute
	$(BIN)/python tools/check_site.py --enforce code-cells --enforce figures

# Only the float-sensitive checks, natively and under OTHER_CPU: what to run on another machine
# to see whether its rounding keeps every exact comparison exact and every bound a bound.
test-numerics: $(STAMP)
	$(BIN)/python -m pytest tests -q -m numerics
	$(OTHER_CPU) $(BIN)/python -m pytest tests -q -m numerics
	$(NBVAL)
	$(OTHER_CPU) $(NBVAL)

# The notebooks in JupyterLab, the book's second way in (the planners' sliders work here). The
# server's root is the repository. It also serves the built site (_build/html) at /static/, where
# each notebook's first cell links to its chapter, rendered: build it first (make book, or from
# the committed outputs in a minute: .venv/bin/python tools/build_book.py --no-execute).
# tools/lab-settings/overrides.json changes two defaults: no first-run prompt about Jupyter's news
# (it covers the notebook) and no update check; a reader's own settings still win.
# LAB_ARGS passes options to `jupyter lab`, for example:
#   make lab LAB_ARGS="--port 8890"                a port other than 8888 (the first free one)
#   make lab LAB_ARGS="--no-browser"               print the URL (with its token), open no browser
#   make lab LAB_ARGS="--no-browser --port 8890"   on a remote machine; then on your own, run
#     ssh -N -L 8890:localhost:8890 user@remote    and open the printed http://localhost:8890/... URL
lab: $(STAMP)
	@[ -f _build/html/index.html ] || echo "note: _build/html is not built, so the notebooks' chapter links will not open yet: run make book (or .venv/bin/python tools/build_book.py --no-execute, from the committed outputs)"
	$(BIN)/jupyter lab --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks \
	  --ServerApp.extra_static_paths="['$(CURDIR)/_build/html']" \
	  --LabApp.app_settings_dir=$(CURDIR)/tools/lab-settings \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# The browser check alone, on the site already in _build/html (after `make book`, say).
check-site: $(STAMP) chromium
	$(BIN)/python tools/check_site.py

# A GPU box: its own Python and CUDA torch, no venv, no torch download (tools/box_setup.py).
# `make box-test WHEELS=dir` installs only what requirements-box.txt lists and the box lacks,
# under .box/, from the wheels in dir (or from the registry without WHEELS), then runs the labs'
# tests and every notebook under nbval. No site build: that needs the book toolchain.
BOX_PYTHON ?= python3
BOX_NBVAL := $(BOX_PYTHON) -m pytest --nbval notebooks --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider -q
box-test:
	$(BOX_PYTHON) tools/box_setup.py --for test $(if $(WHEELS),--wheels $(WHEELS))
	. .box/env && LABS_BACKEND=gloo $(BOX_PYTHON) -m pytest tests -q
	. .box/env && $(BOX_NBVAL)

# The notebooks in JupyterLab on a GPU box, which usually has no JupyterLab: `make box-lab
# WHEELS=dir` installs what requirements-box.txt's `# lab` lines add and the box lacks (under
# .box/, from the same wheels folder), then serves on 127.0.0.1:8888; from your machine,
# `ssh -L 8888:127.0.0.1:8888 BOX` and open the URL it prints.
box-lab:
	$(BOX_PYTHON) tools/box_setup.py --for lab $(if $(WHEELS),--wheels $(WHEELS))
	. .box/env && $(BOX_PYTHON) -m jupyter lab --no-browser --ip=127.0.0.1 --port=8888 \
	  --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# A lent GPU's few minutes in one command, at most 8 (tools/gpu_check.py): provenance, the FP8
# probe, the labs at world size 1 on NCCL, python -m labs.gpu, the tests whose outcome depends on
# the box, chapter 15's exercise where it exists; each part under its own time limit, results in
# results/gpu/. Nothing to install: the box's own Python, torch and pytest.
gpu-check:
	$(BOX_PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

# Every rank function under the device audit (tests/test_devices.py), the slow ones included.
test-devices: $(STAMP)
	LABS_AUDIT_ALL=1 $(BIN)/python -m pytest tests/test_devices.py -q

# On a machine with network: the wheels a box with Python $(BOX_PY_VERSION) on x86-64 Linux needs
# for box-test, into wheels/ (copy the folder to the box and pass WHEELS=wheels).
BOX_PY_VERSION ?= 3.12
box-wheels:
	$(BOX_PYTHON) -m pip download -q -d wheels -r requirements-box.txt --only-binary=:all: \
	  --python-version $(BOX_PY_VERSION) --implementation cp $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64)

clean:
	rm -rf _build
