# The commands the README names. Tests need a Redis: REDIS_ADDR, else a
# redis-server on PATH is started on a free port (see internal/redistest).
GO ?= go
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)

.PHONY: test test-long bench bench-idle lint fuzz faults

# Every guarantee (G1-G8) on a real Redis, in about 3 minutes. -p 1: the
# timing tests of different packages must not compete for the machine's
# two cores. -parallel 8: light scenarios of one package (the learning
# runs, functional queue tests) run side by side. -short skips the long
# scenarios, which make test-long runs.
test:
	$(GO) test -race -count=1 -p 1 -parallel 8 -short ./...

# The long scenarios (TestLong..., marked with redistest.Long): a minute of
# rate learning, fault runs through the CLI worker with asynq's default
# retry backoff, three workers and a SIGKILL that waits out asynq's lease.
# About 4.5 minutes; CI runs it after make test.
LONG_PKGS := $(sort $(dir $(shell grep -rl --include='*_test.go' '^func TestLong' .)))
test-long:
	$(GO) test -race -count=1 -p 1 -parallel 8 -run '^TestLong' $(or $(LONG_PKGS),./...)

# The gate's own speed, then the side-by-side benchmark against the
# alternatives (writes docs/bench.md and docs/bench.svg; about 8 minutes).
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count 6 ./shaper | tee bench.txt
	benchstat bench.txt
	$(GO) run ./bench -out docs
	$(GO) run ./bench -scale -out docs

# What serving 200 idle vendors costs in Redis commands/s, goroutines and
# CPU, beside plain asynq on the same queues (writes docs/idle.md; 1 minute).
bench-idle:
	$(GO) run ./bench -idle -out docs

lint:
	@test -z "$$(gofmt -l .)" || (echo "gofmt needed:"; gofmt -l .; exit 1)
	$(GO) vet ./...
	$(STATICCHECK) ./...

fuzz:
	$(GO) test -run '^$$' -fuzz 'FuzzParse$$' -fuzztime 30s ./config
	$(GO) test -run '^$$' -fuzz FuzzParseCalls -fuzztime 30s ./queue
	$(GO) test -run '^$$' -fuzz FuzzCheckPath -fuzztime 30s ./vendorclients
	$(GO) test -run '^$$' -fuzz FuzzParseRetryAfter -fuzztime 30s ./vendorclients
	$(GO) test -run '^$$' -fuzz FuzzParseHints -fuzztime 30s ./vendorclients

# The fault tests alone: the quick ones (also in make test) and the long
# ones (also in make test-long).
faults:
	$(GO) test -count=1 -p 1 -v -run 'Fault|ThreeWorkersAndAKill|TestGateRedisRestart' ./cmd/shaper ./queue ./shaper
