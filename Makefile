# zbroker: every target creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_STAMP := clients/node/node_modules/.installed
LOADGEN := bench/loadgen/zbload
DURATION ?= 1800
# pytest-xdist workers for `make test`: serially the suite mostly waits (load under
# 0.5 on two cores), so more workers than cores pays: on this 2-core machine 6 workers
# ran the parallel part in 444 s under a load of 13 from other work, where 4 had taken
# 524 s an hour before at a load of 2-5 (2026-12-05). worksteal, because a few tests
# take minutes (the chaos run, the stateful model, the actor fuzzers) and must not
# hold a queue of short ones behind them. No test needs a worker to itself: ports are
# random free blocks, PostgreSQL schemas are per worker, the Redis test uses a fake.
TEST_WORKERS ?= 6
# What needs no process and no service: everything else in tests/.
FAST := not processes and not postgres and not node

.PHONY: up test test-fast bench chaos node loadgen browser clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

$(NODE_STAMP): clients/node/package.json
	cd clients/node && npm install --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

node: $(NODE_STAMP)

# The C load generator of the broker-capacity rows, from Debian's libzmq and msgpack-c.
$(LOADGEN): bench/loadgen/zbload.c bench/loadgen/Makefile
	pkg-config --exists libzmq msgpack 2>/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libzmq3-dev libmsgpack-dev pkg-config)
	$(MAKE) -s -C bench/loadgen

loadgen: $(LOADGEN)

## Debian's chromium and chromedriver, for the console's browser tests (tests/console).
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	else apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; fi

## Run a single-node broker in the foreground on its embedded defaults.
up: $(STAMP)
	$(VENV)/bin/zbroker up

## The whole suite, PostgreSQL and Node.js tests included, on $(TEST_WORKERS) workers.
test: $(STAMP) $(NODE_STAMP) $(LOADGEN)
	$(PY) -m pytest -q --durations=40 -n $(TEST_WORKERS) --dist worksteal -m "not serial"; \
	parallel=$$?; $(PY) -m pytest -q -p no:cacheprovider -m serial; serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

## Every test that starts no process and needs no service, from the whole tests/ tree
## (the coordinator's stateful model with 30 examples rather than make test's 300).
test-fast: $(STAMP)
	ZBROKER_MODEL_EXAMPLES=30 $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "$(FAST)" tests

## Side-by-side benchmark against RabbitMQ, NATS JetStream, Redis Streams and raw ZeroMQ.
bench: $(STAMP) $(LOADGEN)
	$(PY) -m bench

## The long chaos runs: make chaos DURATION=1800 [CHAOS=single|replicated|cluster|both]
## (single: one host, actors SIGKILLed, the database cut; replicated: three hosts at R = 3
## lost with and without their disks, leaders cut off and paused; cluster: three `zbroker up`
## nodes on one PostgreSQL, the leading node killed, paused past its lease, cut off the
## database, nodes restarted; both: all of them, one after the other).
CHAOS ?= both
CHAOS_SELECT_single := -k "not host_loss and not in_a_cluster"
CHAOS_SELECT_replicated := -k "host_loss or test_checker"
CHAOS_SELECT_cluster := -k "in_a_cluster or test_checker"
CHAOS_SELECT_both :=
chaos: $(STAMP)
	@test -n "$(filter $(CHAOS),single replicated cluster both)" || { echo "CHAOS must be single, replicated, cluster or both"; exit 2; }
	$(PY) -m pytest -q tests/chaos -m chaos --chaos-duration=$(DURATION) -p no:cacheprovider $(CHAOS_SELECT_$(CHAOS))

clean:
	rm -rf $(VENV) clients/node/node_modules build *.egg-info $(LOADGEN)
