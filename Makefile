# memlab: build, install and test.  `make lab` opens the workbook, `make test` checks it.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp

# DeepSpeed / torch JIT-compiled ops are cached here (kept out of $HOME, ignored by git).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions

PYTEST_TIMEOUT ?= 900
# one slow test may run every notebook (the site: about 35 minutes on 2 cores)
SLOW_TIMEOUT ?= 4800
NBVAL_CELL_TIMEOUT ?= 300
# jupyter refuses to start as root unless told
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: help venv lab lint test test-fast test-slow test-notebooks bench gpu-check strip student clean
.PHONY: test-package test-notebooks-one test-notebooks-rank
.PHONY: instructor doctor site wheelhouse

help:
	@echo "make lab         open the learner's edition in JupyterLab: student/, exercises blank (made first,"
	@echo "                 never over your edits; installs on first run)"
	@echo "make lab EDITION=solutions    the same notebooks with their solutions (notebooks/);"
	@echo "                 EDITION=instructor: with the answer keys appended (build/instructor/)"
	@echo "make lint        ruff over memlab, tests, tools and benchmarks (pyproject.toml's config)"
	@echo "make test        lint, package tests, then every notebook under nbval; the time of each phase at the end"
	@echo "make test-fast   lint, package tests only"
	@echo "make test-slow   the slow tests make test leaves out: H200 replays, every notebook as a class, the site"
	@echo "make test-notebooks  notebooks under nbval only"
	@echo "make bench       run benchmarks/*.py"
	@echo "make gpu-check   CUDA tests, reference steps and every notebook on this GPU (PY=python3: no venv;"
	@echo "                 CARD=T4-16GB rehearses a smaller card; DRY=1 prints the plan, no GPU needed)"
	@echo "make strip       remove outputs from notebooks/*.ipynb"
	@echo "make student     the workbook without solutions, in student/ (never over your edits; FORCE=1)"
	@echo "make instructor  notebooks with the answer keys appended, in build/instructor/"
	@echo "make doctor      pre-flight check: versions, cores, GPU, DeepSpeed op, two ranks, verdict"
	@echo "make site        execute every notebook, write a static HTML site to build/site/"
	@echo "make wheelhouse  every wheel the venv needs, in wheelhouse/ (then: make venv WHEELHOUSE=wheelhouse)"
	@echo "make venv|clean  (make clean keeps student/)"

venv: $(STAMP)

# WHEELHOUSE=dir: install with no network, from the wheels `make wheelhouse` wrote
PIP_SOURCE = $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE))

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_SOURCE) --upgrade pip -c constraints.txt
	$(PY) -m pip install -q $(PIP_SOURCE) -c constraints.txt -e '.[lab,dist,test,hf]'
	@touch $@

# Every notebook names the kernel "python3", which ipykernel provides in whatever environment
# runs it: the venv's own Python here (tools/nbstrip.py --check enforces the name).
# `make lab` opens the learner's copy, student/ (made first, never over their edits: `make
# student`); EDITION=solutions the notebooks as committed, EDITION=instructor with the answer keys.
EDITION ?= student
EDITIONS := student solutions instructor
STUDENT_DIR ?= student
# an unknown edition stops before anything is installed or opened
ifneq ($(filter lab,$(MAKECMDGOALS)),)
ifneq ($(words $(filter $(EDITIONS),$(EDITION))) $(words $(EDITION)),1 1)
$(error EDITION=$(EDITION); allowed: $(EDITIONS))
endif
endif
LAB_DIR = $(if $(filter student,$(EDITION)),$(STUDENT_DIR),$(if $(filter instructor,$(EDITION)),build/instructor,notebooks))/
lab: venv $(if $(filter student,$(EDITION)),student) $(if $(filter instructor,$(EDITION)),instructor)
	$(PY) -m jupyter lab $(LAB_ARGS) $(LAB_DIR)

# seconds, and a lint error fails before the minutes of tests start
lint: venv
	$(PY) -m ruff check memlab tests tools benchmarks

# each phase a make target of its own, timed (tools/phase_timer.py prints the table at the end,
# failed or not); the first failing phase stops the run, as before
SUBMAKE = $(MAKE) --no-print-directory
test: venv
	@$(PYTHON) tools/phase_timer.py "lint=$(SUBMAKE) lint" "package tests=$(SUBMAKE) test-package" \
	  "notebooks=$(SUBMAKE) test-notebooks-one" "rank notebooks=$(SUBMAKE) test-notebooks-rank"

test-package: venv
	$(run-tests)

test-notebooks-one: venv
	$(PYTHON) tools/nbstrip.py --check
	$(NBVAL) $(XDIST) --dist loadscope $(ONE_NOTEBOOKS)

test-notebooks-rank: venv
	$(NBVAL) $(RANK_XDIST) $(RANK_NOTEBOOKS)

test-fast: lint
	$(run-tests)

# The replays and whole-workbook runs (every notebook collected as a class, the whole site:
# about an hour on 2 cores); `make test` runs their fast subsets.
test-slow: venv
	@mkdir -p $(TORCH_EXTENSIONS_DIR)
	MPLBACKEND=Agg $(PY) -m pytest $(XDIST) --timeout=$(SLOW_TIMEOUT) -m slow tests/

test-notebooks: venv
	$(run-notebooks)

# pytest exits 5 when it collects nothing: say so instead of failing
# Two pytest workers, one thread each: on a 2-core machine that halves the wall time, and
# torch's own threads no longer fight the other worker (or the ranks of a multi-rank test).
export OMP_NUM_THREADS ?= 1
XDIST ?= -n 2
# Notebooks that start ranks (two each) and time them (bubbles, step ratios): two notebooks
# at a time (RANK_JOBS=1: one at a time, as on a single core), each whole notebook on one
# worker (loadscope); the longest, lesson 15, then runs beside the others.
RANK_JOBS ?= 2
RANK_XDIST = $(if $(filter 1,$(RANK_JOBS)),,-n $(RANK_JOBS) --dist loadscope)
RANK_NOTEBOOKS := $(wildcard notebooks/09_*.ipynb notebooks/10_*.ipynb notebooks/11_*.ipynb notebooks/12_*.ipynb notebooks/13_*.ipynb notebooks/15_*.ipynb)
ONE_NOTEBOOKS := $(filter-out $(RANK_NOTEBOOKS),$(wildcard notebooks/*.ipynb))
NBVAL := MPLBACKEND=Agg $(PY) -m pytest --nbval --nbval-current-env -p no:cacheprovider \
  --nbval-cell-timeout=$(NBVAL_CELL_TIMEOUT)

# Tests marked slow each have a fast sibling in the default run (the first H200 row of each
# kind, the tiny plan, the tiny guard row, the installed package's import, lesson 02 collected
# as a class, lesson 00's site page): `make test-slow`.
define run-tests
@mkdir -p $(TORCH_EXTENSIONS_DIR)
MPLBACKEND=Agg $(PY) -m pytest $(XDIST) --timeout=$(PYTEST_TIMEOUT) -m "not slow" tests/
endef

# notebooks are committed stripped: nbval executes every cell and the assert cells test
define run-notebooks
$(PYTHON) tools/nbstrip.py --check
$(NBVAL) $(XDIST) --dist loadscope $(ONE_NOTEBOOKS)
$(NBVAL) $(RANK_XDIST) $(RANK_NOTEBOOKS)
endef

bench: venv
	@shopt -s nullglob; files=(benchmarks/*.py); \
	if [ $${#files[@]} -eq 0 ]; then echo "benchmarks/: nothing to run"; fi; \
	for f in "$${files[@]}"; do echo "== $$f"; MPLBACKEND=Agg $(PY) "$$f" || exit $$?; done

# On a GPU machine with no venv: `make gpu-check PY=python3` uses that interpreter as it is,
# and the notebook kernels import this checkout (PYTHONPATH). `pytest -m cuda`, the reference
# steps sized for the card, then every notebook under nbval (rank notebooks one at a time, the
# others two at a time), going on past failures; logs and one table (notebook, pass/fail,
# wall time, card profile) in build/gpu-check/<card>/, never in memlab/data/reference/.
# `CARD=T4-16GB` rehearses that card on a larger GPU (memory cap, no flash, fp16);
# `DRY=1` prints the plan per notebook per card, on any machine.
CARD ?=
DRY ?=
GPU_CHECK_OUT ?= build/gpu-check
GPU_CHECK_PY = $(if $(filter command line,$(origin PY)),$(PY),$(if $(DRY),$(if $(wildcard $(PY)),$(PY),$(PYTHON)),$(PY)))
GPU_CHECK_ENV = PYTHONPATH=$(CURDIR) MEMLAB_CARD=$(CARD) MPLBACKEND=Agg

gpu-check: $(if $(or $(filter command line,$(origin PY)),$(DRY)),,venv)
ifneq ($(DRY),)
	@$(GPU_CHECK_ENV) $(GPU_CHECK_PY) -m memlab.app.gpu_check --dry-run $(if $(CARD),--card $(CARD)) \
	  --out $(GPU_CHECK_OUT) --notebooks $(RANK_NOTEBOOKS) $(ONE_NOTEBOOKS)
else
	@mkdir -p $(TORCH_EXTENSIONS_DIR) $(GPU_CHECK_OUT)
	-$(GPU_CHECK_ENV) $(GPU_CHECK_PY) -m pytest -m cuda -p no:cacheprovider tests/ \
	  2>&1 | tee $(GPU_CHECK_OUT)/pytest-cuda$(if $(CARD),-$(CARD)).log
	$(GPU_CHECK_ENV) $(GPU_CHECK_PY) -m memlab.app.gpu_check --out $(GPU_CHECK_OUT) \
	  --notebooks $(RANK_NOTEBOOKS) $(ONE_NOTEBOOKS)
endif

strip:
	$(PYTHON) tools/nbstrip.py

# every code cell tagged "solution" becomes an empty "# your code here" cell; the copy lives in
# student/ (not build/, so `make clean` keeps it) and a notebook the learner changed is kept
# (the new one goes beside it as NN_name.new.ipynb) unless FORCE=1
student:
	$(PYTHON) tools/make_student.py --out $(STUDENT_DIR) $(if $(FORCE),--force)

# notebooks with course/answers/<stem>.md appended as markdown cells
instructor:
	$(PYTHON) tools/make_instructor.py --out build/instructor

doctor: venv
	@mkdir -p $(TORCH_EXTENSIONS_DIR)
	$(PY) -m memlab.app.cli doctor

# executes every notebook (rank-starting ones too, one at a time) into a static HTML site
SITE_TIMEOUT ?= 900
site: venv
	@mkdir -p $(TORCH_EXTENSIONS_DIR)
	$(PY) tools/make_site.py --out build/site --timeout $(SITE_TIMEOUT)

# every wheel the venv needs (DeepSpeed's sdist built into a wheel), for a classroom with no network
WHEELHOUSE_DIR ?= wheelhouse
wheelhouse:
	$(PYTHON) -m pip wheel -q -w $(WHEELHOUSE_DIR) -c constraints.txt pip setuptools wheel '.[lab,dist,test,hf]'
	@du -sh $(WHEELHOUSE_DIR); ls $(WHEELHOUSE_DIR) | wc -l

clean:
	rm -rf .cache .pytest_cache build dist *.egg-info
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print0 | xargs -0 rm -rf
