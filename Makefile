# memlab: build, install and test.  `make lab` opens the workbook, `make test` checks it.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp
KERNEL := $(VENV)/share/jupyter/kernels/memlab/kernel.json

# DeepSpeed / torch JIT-compiled ops are cached here (kept out of $HOME, ignored by git).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions

PYTEST_TIMEOUT ?= 900
NBVAL_CELL_TIMEOUT ?= 300
# jupyter refuses to start as root unless told
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: help venv kernel lab test test-fast test-notebooks bench gpu-check strip student clean

help:
	@echo "make lab         open the workbook in JupyterLab (installs on first run)"
	@echo "make test        package tests, then every notebook under nbval"
	@echo "make test-fast   package tests only"
	@echo "make test-notebooks  notebooks under nbval only"
	@echo "make bench       run benchmarks/*.py"
	@echo "make gpu-check   CUDA tests + reference numbers into data/reference (needs a GPU)"
	@echo "make strip       remove outputs from notebooks/*.ipynb"
	@echo "make student     the workbook without solutions, in build/student/"
	@echo "make venv|kernel|clean"

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip -c constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[lab,dist,test]'
	@touch $@

kernel: $(KERNEL)

# --sys-prefix: the kernelspec lives inside the venv (no $HOME writes; fine as root and in CI)
$(KERNEL): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name memlab --display-name "Python (memlab)"

lab: venv kernel
	$(PY) -m jupyter lab $(LAB_ARGS) notebooks/

test: venv kernel
	$(run-tests)
	$(run-notebooks)

test-fast: venv
	$(run-tests)

test-notebooks: venv kernel
	$(run-notebooks)

# pytest exits 5 when it collects nothing: say so instead of failing
# Two pytest workers, one thread each: on a 2-core machine that halves the wall time, and
# torch's own threads no longer fight the other worker (or the ranks of a multi-rank test).
export OMP_NUM_THREADS ?= 1
XDIST ?= -n 2
# Notebooks that start ranks and time them (bubbles, step ratios) run one at a time.
RANK_NOTEBOOKS := $(wildcard notebooks/06_*.ipynb notebooks/07_*.ipynb notebooks/08_*.ipynb notebooks/11_*.ipynb)
ONE_NOTEBOOKS := $(filter-out $(RANK_NOTEBOOKS),$(wildcard notebooks/*.ipynb))
NBVAL := MPLBACKEND=Agg $(PY) -m pytest --nbval --nbval-current-env -p no:cacheprovider \
  --nbval-cell-timeout=$(NBVAL_CELL_TIMEOUT)

define run-tests
@mkdir -p $(TORCH_EXTENSIONS_DIR)
MPLBACKEND=Agg $(PY) -m pytest $(XDIST) --timeout=$(PYTEST_TIMEOUT) tests/
endef

# notebooks are committed stripped: nbval executes every cell and the assert cells test
define run-notebooks
$(PYTHON) tools/nbstrip.py --check
$(NBVAL) $(XDIST) --dist loadscope $(ONE_NOTEBOOKS)
$(NBVAL) $(RANK_NOTEBOOKS)
endef

bench: venv
	@shopt -s nullglob; files=(benchmarks/*.py); \
	if [ $${#files[@]} -eq 0 ]; then echo "benchmarks/: nothing to run"; fi; \
	for f in "$${files[@]}"; do echo "== $$f"; MPLBACKEND=Agg $(PY) "$$f" || exit $$?; done

gpu-check: venv
	$(PY) -m pytest -m cuda tests/ || { rc=$$?; [ $$rc -eq 5 ] && echo "no cuda tests collected"; [ $$rc -eq 5 ]; }
	@mkdir -p data/reference
	$(PY) -m memlab.gpu_check --out data/reference
	MPLBACKEND=Agg $(PY) -m pytest --nbval --nbval-current-env -p no:cacheprovider \
	  --nbval-cell-timeout=$(NBVAL_CELL_TIMEOUT) notebooks/

strip:
	$(PYTHON) tools/nbstrip.py

# every code cell tagged "solution" becomes an empty "# your code here" cell
student:
	$(PYTHON) tools/make_student.py --out build/student

clean:
	rm -rf .cache .pytest_cache build dist *.egg-info
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print0 | xargs -0 rm -rf
