# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TYPECHECK_ROOT := build/typecheck

.PHONY: demo test lint typecheck pytest proto proto-check bench venv clean docker-check docs docs-serve docs-src

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a looser spec would pull a CUDA build of several GB.
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[train,dev,frameworks,docs]'
	touch $(STAMP)

venv: $(STAMP)

# Trains the small model with 2 workers through the coordinator: a few minutes on 2 CPU cores.
demo: $(STAMP)
	$(BIN)/gradserver launch --workers 2 --model small --steps 150 --out runs/demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy resolves modules by path, so it checks the package through a tree of links that
# mirrors its installed layout (gradserver/common -> common, ...).
typecheck: $(STAMP)
	rm -rf $(TYPECHECK_ROOT) && mkdir -p $(TYPECHECK_ROOT)/gradserver
	for part in common server worker train cli; do ln -s ../../../$$part $(TYPECHECK_ROOT)/gradserver/$$part; done
	ln -s ../../../torch_backend $(TYPECHECK_ROOT)/gradserver/torch
	cd $(TYPECHECK_ROOT) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p gradserver

pytest: $(STAMP)
	$(BIN)/pytest

# The documentation site (mkdocs.yml), built strictly: a broken link, a missing page or an API
# reference that does not resolve fails it. mkdocstrings reads the package's sources through a
# tree of links that mirrors its installed layout, as mypy does.
DOCS_SRC := build/docs-src
docs-src:
	rm -rf $(DOCS_SRC) && mkdir -p $(DOCS_SRC)/gradserver
	for part in common server worker train cli; do ln -s ../../../$$part $(DOCS_SRC)/gradserver/$$part; done
	ln -s ../../../torch_backend $(DOCS_SRC)/gradserver/torch

docs: $(STAMP) docs-src
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

docs-serve: $(STAMP) docs-src
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

proto: $(STAMP)
	$(BIN)/python proto/generate.py

proto-check: $(STAMP)
	$(BIN)/python proto/generate.py --check

bench: $(STAMP)
	$(BIN)/python -m bench.exchange

# Both images (coordinator, worker) and the compose job under a real Docker engine (root;
# installs Debian's docker.io when missing): see docker/check.sh. About 3 minutes on 2 CPU cores
# with the engine installed and the base image cached, about 4 from nothing.
docker-check:
	bash docker/check.sh

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
