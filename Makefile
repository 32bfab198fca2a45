# The commands the README names. Tests need a Redis: REDIS_ADDR, else a
# redis-server on PATH is started on a free port (see internal/redistest).
GO ?= go
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)

.PHONY: test bench lint fuzz faults

# -p 1: the timing tests of different packages must not compete for the
# machine's two cores. -parallel 8: the learning scenarios (light traffic,
# 70 s each) run side by side.
test:
	$(GO) test -race -count=1 -p 1 -parallel 8 ./...

# The gate's own speed, then the side-by-side benchmark against the
# alternatives (writes docs/bench.md and docs/bench.svg; about 8 minutes).
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count 6 ./shaper | tee bench.txt
	benchstat bench.txt
	$(GO) run ./bench -out docs

lint:
	@test -z "$$(gofmt -l .)" || (echo "gofmt needed:"; gofmt -l .; exit 1)
	$(GO) vet ./...
	$(STATICCHECK) ./...

fuzz:
	$(GO) test -run '^$$' -fuzz 'FuzzParse$$' -fuzztime 30s ./config
	$(GO) test -run '^$$' -fuzz FuzzParseJobs -fuzztime 30s ./queue
	$(GO) test -run '^$$' -fuzz FuzzCheckPath -fuzztime 30s ./vendorclients
	$(GO) test -run '^$$' -fuzz FuzzParseRetryAfter -fuzztime 30s ./vendorclients
	$(GO) test -run '^$$' -fuzz FuzzParseHints -fuzztime 30s ./vendorclients

# The fault tests alone (they also run in make test).
faults:
	$(GO) test -count=1 -v -run 'TestFault|TestThreeWorkersAndAKill|TestGateRedisRestart' ./cmd/shaper ./shaper
