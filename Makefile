# The commands the README names. Tests need a Redis: REDIS_ADDR, else a
# redis-server on PATH is started on a free port (see internal/redistest).
GO ?= go
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)

.PHONY: test test-long bench bench-idle bench-learn lint fuzz faults

# Every guarantee (G1-G8) on a real Redis: 5.3 minutes with a warm build
# cache (measured 2026-12-02; 7.7 from a cold one before the quota, cost
# and lane tests). -p 1: the
# timing tests of different packages must not compete for the machine's
# two cores. -parallel 8: light scenarios of one package (the learning
# runs, functional queue tests) run side by side. -short skips the long
# scenarios, which make test-long runs.
test:
	$(GO) test -race -count=1 -p 1 -parallel 8 -short ./...

# The long scenarios (TestLong..., marked with redistest.Long): a minute of
# rate learning, fault runs through the CLI worker with asynq's default
# retry backoff, three workers and a SIGKILL that waits out asynq's lease,
# a Sentinel failover, a 30 s Redis outage, a million queued calls. Under
# -race, except the scenarios that measure delivered share over a minute
# against a strict-spacing vendor (nginx limit_req), through network
# jitter, or while learning a vendor's limit: their margins are a few
# milliseconds, and the race detector slows the worker by that much on two
# cores (nginx 85-88% under -race, 88-90% without; one convergence run
# 91.6% under -race beside eight others). Their code paths run under -race
# in make test. Like every wall-clock test they assert safety only (no
# window above its limit, 429s bounded, nothing lost) and log the shares;
# shares are measured by benchmarks, never asserted.
# About 16 minutes.
LONG_PKGS := $(sort $(dir $(shell grep -rl --include='*_test.go' '^func TestLong' .)))
UNRACED := 'TestLong(StrictSpacing|NetworkJitter|ConvergesOnTheTrueLimit)'
test-long:
	$(GO) test -race -count=1 -p 1 -parallel 9 -timeout 30m -run '^TestLong' -skip $(UNRACED) $(or $(LONG_PKGS),./...)
	$(GO) test -count=1 -p 1 -parallel 9 -timeout 10m -run $(UNRACED) ./queue

# The gate's own speed (BenchmarkReserve) and Redis CPU per grant beside
# redis_rate's GCRA (BenchmarkRedisCPU, redis-µs/grant), then the
# side-by-side benchmark against the alternatives (writes docs/bench.md
# and docs/bench.svg; about 8 minutes).
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count 6 ./shaper | tee bench.txt
	benchstat bench.txt
	$(GO) run ./bench -out docs
	$(GO) run ./bench -scale -out docs

# The learning figures (docs/learning.md): the simulator's table (the same
# on every machine; TestLearningSimulated also asserts it in make test)
# and the shares the wall-clock scenarios deliver here, which they log but
# do not assert: nine vendors configured at twice their limit, nginx
# limit_req without burst (learned, strict_spacing, a fixed guard), 0-40 ms
# of network jitter, a quiet fixed-window vendor. Without -race, one
# scenario at a time. About 6 minutes.
LEARN_RUNS := 'TestLearningSimulated|TestWorkersDrainAtTheRate|TestLong(ConvergesOnTheTrueLimit|StrictSpacing|NetworkJitter)'
bench-learn:
	$(GO) test -count=1 -p 1 -parallel 9 -timeout 20m -v -run $(LEARN_RUNS) ./shaper ./queue > learn.txt || (tail -50 learn.txt; exit 1)
	$(GO) run ./bench -learn learn.txt -out docs -learn-command "make bench-learn"

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
# ones (also in make test-long): worker kills, Redis restarts, a Sentinel
# failover, a 30 s outage, a stalled Redis, a stale copy of the gate,
# eviction, TLS and ACLs, secrets, a million queued calls.
FAULTS := 'Fault|ThreeWorkersAndAKill|TestGateRedisRestart|TestGateStaleCopy|TestGateMissingStateAfterSwitch|EvictingRedis|TLSAndLeastPrivilegeACL|WaitsForReplicas|SecretsStayOut|MillionQueuedCalls'
faults:
	$(GO) test -count=1 -p 1 -parallel 4 -timeout 30m -v -run $(FAULTS) ./cmd/shaper ./queue ./shaper
