# Every target installs what it needs first (launch/setup.sh creates .venv if missing).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ultrascale-installed
WORLD_SIZE ?= 3

# The oldest torch the course supports (ultrascale.SUPPORTED_TORCH), tested by test-compat in an
# environment kept between runs.
TORCH_OLDEST := 2.11.0
COMPAT_VENV ?= $(HOME)/.cache/ultrascale/venv-torch-$(TORCH_OLDEST)

.PHONY: setup lab lab-headless test test-gpu test-compat test-fast busy-check notebooks batch bench exercises grade progress site format clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml launch/setup.sh
	bash launch/setup.sh
	touch $(STAMP)

setup: $(STAMP)

lab:            ## start JupyterLab on the course (opens a browser)
	bash launch/lab.sh

lab-headless:   ## JupyterLab for a server: no browser, port 8888
	HEADLESS=1 bash launch/lab.sh

test: $(STAMP)  ## every test: library, runtime faults, grading, notebooks (nbval + papermill), spelling
	bash launch/test.sh

test-gpu: $(STAMP)  ## on a GPU node: the GPU tests, every chapter with one rank per GPU (NCCL), the grader; one table
	$(PY) launch/test_gpu.py

test-compat:    ## the library's tests and every chapter (papermill, QUICK) under the oldest supported torch
	VENV=$(COMPAT_VENV) TORCH_VERSION=$(TORCH_OLDEST) TORCH_FRESH=1 bash launch/setup.sh
	VENV=$(COMPAT_VENV) bash launch/test_compat.sh

busy-check: $(STAMP)  ## the timing chapters (07 a0 02 05 06 10) N times each beside another chapter's run, QUICK, WORLD_SIZE 3; a pass/fail table: make busy-check N=1 CHAPTERS="07 10"
	$(PY) launch/busy_check.py --repeats $(or $(N),5) $(CHAPTERS)

notebooks: $(STAMP)  ## re-execute the chapters and save their outputs (the nbval reference)
	$(PY) launch/build_notebooks.py

batch: $(STAMP)  ## run chapters headless with papermill into out/: make batch CHAPTERS="06 12" (default all), WORLD_SIZE=...
	$(PY) launch/batch.py --world-size $(WORLD_SIZE) $(or $(CHAPTERS),chapters)

exercises: $(STAMP)  ## regenerate exercises/ from solutions/, then refresh your copies in work/ (never overwrites your edits)
	$(PY) -m ultrascale_grading.generate
	$(PY) -m ultrascale.workspace --quiet

grade: $(STAMP)  ## grade your exercises in work/exercises (recorded for make progress): make grade NB=path JOBS=2 JSON=scores.json
	$(if $(NB),,$(PY) -m ultrascale.workspace --quiet)
	$(PY) -m ultrascale_grading.cli $(or $(NB),work/exercises) --jobs $(or $(JOBS),1) $(if $(JSON),--json $(JSON))

progress: $(STAMP)  ## per chapter, the exercises you passed and your points, from the grader's records (make grade)
	$(PY) -m ultrascale_grading.progress

site: $(STAMP)  ## the course as a website in site/html (saved outputs, nothing executed): python -m http.server -d site/html
	$(PY) site_src/build.py

bench: $(STAMP)  ## side-by-side benchmarks, printing ratios (GPU ones say so and skip without a GPU)
	$(PY) benchmarks/bench_runtime.py
	$(PY) benchmarks/bench_send_recv.py
	$(PY) benchmarks/bench_ring_allreduce.py
	$(PY) benchmarks/bench_dp_zero.py
	$(PY) benchmarks/bench_tp.py
	$(PY) benchmarks/bench_pp.py
	$(PY) benchmarks/bench_cp.py
	$(PY) benchmarks/bench_ep.py
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_fp8.py
	$(PY) benchmarks/bench_mfu.py

format: $(STAMP)  ## rewrite the library, tests, benchmarks, launch scripts and chapter sources in ruff's format
	$(VENV)/bin/ruff format lib tests benchmarks launch chapters/*.py

clean:
	rm -rf $(VENV) out
