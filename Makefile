# offtop: two entry points, both idempotent and quiet once everything is in place.
#   make run [ARGS="--batch --count 3"]   set up, then run offtop (needs root)
#   make test                             set up, then run the whole test suite
SHELL := /bin/bash
PY := /usr/bin/python3
VENV := .venv
ARCH := $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
SYSTEM_PKGS := python3-bpfcc python3-venv linux-headers-$(ARCH) gcc libc6-dev libc6-dbg gdb tmux bpftool golang-go
ARGS ?=

.PHONY: run test setup system lint bench bench-system
run: setup
	@$(VENV)/bin/offtop $(ARGS)

test: setup
	@$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check offtop tests bench && $(VENV)/bin/mypy offtop

#   make bench [ARGS="--quick"]            benchmarks (bench/README.md); needs root
bench: setup bench-system
	@$(VENV)/bin/python bench/run.py $(ARGS)

# Benchmarks only: bpftrace, the tool offtop's cost is compared with.
bench-system:
	@$(MAKE) --no-print-directory system SYSTEM_PKGS="bpftrace htop"

# The BPF program for offtop's default options, compiled into offtop's cache ahead of the
# first start (quiet when it is there already; a cache offtop cannot trust is recompiled at start).
setup: system $(VENV)/.stamp-install
	@$(VENV)/bin/python -m offtop.bpf.loader.precompile

# Debian packages: bcc's Python bindings, a generic kernel header tree for bcc to compile
# against, a compiler for the test workloads, libc's detached symbols (libc6-dbg: its
# local functions by name, e.g. __libc_start_call_main), gdb to check stacks against,
# tmux for the terminal end-to-end test, bpftool to check that no probe outlives
# offtop, golang-go for `go tool pprof` (reads offtop's pprof files in the tests).
system:
	@missing=""; for p in $(SYSTEM_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "offtop setup: installing$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "offtop setup: need root to apt-get install$$missing" >&2; exit 1; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends $$missing >/dev/null || exit 1; \
	fi

$(VENV)/bin/python:
	@$(PY) -m venv --system-site-packages $(VENV)

$(VENV)/.stamp-install: $(VENV)/bin/python pyproject.toml requirements-lock.txt
	@echo "offtop setup: installing Python packages into $(VENV)"
	@$(VENV)/bin/pip install -q --disable-pip-version-check -c requirements-lock.txt -e '.[test]' 2>&1 \
	  | grep -v "is neither a file nor a directory" || true
	@$(VENV)/bin/python -c "import textual, psutil, pytest, offtop" && touch $@
