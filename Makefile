# The commands the README names. Tests need a Redis: REDIS_ADDR, else a
# redis-server on PATH is started on a free port (see internal/redistest).
GO ?= go
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)

.PHONY: bench-export bench-order build test test-redis test-browser test-nginx test-examples test-race test-long test-long-cli test-long-race test-long-unraced bench bench-api bench-idle bench-learn lint fuzz fuzz-short fuzz-short-input fuzz-short-vendor faults ui-screenshot

# The binary, into bin/ (shaper/ at the root is the gate's package, so
# go build -o shaper would write into it).
build:
	$(GO) build -o bin/shaper ./cmd/shaper

# Every guarantee (G1-G8), on a machine with Go alone: the tests use
# REDIS_ADDR, else a redis-server on PATH started on a free port, else the
# embedded Redis (and say so). Leaves to their own targets the tests that
# need another program: make test-redis (tests named TestOwnRedis..., which
# start, kill and restart redis-server processes of their own: restarts,
# a stale copy, a cluster, a replica, TLS, eviction), make
# test-browser (the live page in Chromium), make test-nginx (the
# reference limiter against a real nginx), make test-examples (docs'
# curl, Python and Node examples); .ci/run installs them and runs them. The first command builds every test binary on both cores; the
# second runs them two packages at a time (-p 2), light scenarios of one
# package side by side (-parallel 8). -short skips the long scenarios,
# which make test-long runs. Every wall-clock test asserts safety only
# (no window above its limit, 429s bounded, nothing lost); shares are
# asserted on simulated time only. 4m13s from empty build and module
# caches on a 2-core machine with Go alone (2026-12-04; see
# docs/development.md).
test:
	$(GO) test -count=1 -short -run '^$$' ./... > /dev/null
	$(GO) test -count=1 -p 2 -parallel 8 -short -skip '^TestOwnRedis' ./...

# The tests that start redis-server processes of their own: they fail,
# saying what to install, where redis-server is missing.
test-redis:
	$(GO) test -count=1 -p 1 -parallel 8 -short -run '^TestOwnRedis' ./...

# The live page in headless Chromium (chromedp; the test file is built
# with -tags browser only): fails, saying what to install, where Chromium
# is missing.
test-browser:
	$(GO) test -tags browser -count=1 -run '^TestPageInBrowser$$' ./cmd/shaper

# The reference limiter's own tests against a real nginx (limit_req; the
# test file is built with -tags nginx only): fails, saying what to
# install, where nginx is missing.
test-nginx:
	$(GO) test -tags nginx -count=1 ./internal/nginxtest

# docs/examples' programs (curl, Python with requests, Node 18+ fetch)
# against a real API, worker and vendor (the test file is built with
# -tags examples only): fails, saying what to install, where one is
# missing.
test-examples:
	$(GO) test -tags examples -count=1 -run '^TestExamples$$' ./internal/api

# make test under the race detector, with the tests that need
# redis-server: about 9 minutes from a cold cache (the race build of
# every dependency is most of it), 5 warm.
test-race:
	$(GO) test -race -count=1 -short -run '^$$' ./... > /dev/null
	$(GO) test -race -count=1 -p 1 -parallel 8 -short ./...

# The long scenarios (TestLong..., marked with redistest.Long): a minute of
# rate learning, fault runs through the CLI worker with asynq's default
# retry backoff, three workers and a SIGKILL that waits out asynq's lease,
# a Sentinel failover, a 30 s Redis outage, the soak of combined faults, a
# million queued calls. Under
# -race, except: the CLI scenarios (./cmd/shaper), whose workers are
# separate shaper binaries built without it, and which run side by side,
# beside the race run (they mostly wait out faults); and the scenarios
# against a strict-spacing vendor (nginx limit_req), through network
# jitter, or while learning a vendor's limit, whose margins are a few
# milliseconds that the race detector would add to every start, and two
# whose vendors' own timestamps the race detector made lag the calls past
# what the check allows (a hundred accounts' vendors in one process; calls
# of 1-10 units checked in sliding windows 20 ms short of a second at
# their arrival). Their code paths run under -race in make test-race.
# (The high lane's order through workers and FIFO's run in make test since
# the line admits two callers at once: TestHighLaneGoesFirstThroughWorkers,
# TestFIFO.) Every wall-clock scenario asserts safety only (no window
# above its limit, 429s bounded, nothing lost) and logs its shares; make
# bench-learn collects them. About 7 minutes (409 s on a clean clone
# here, 2026-12-03).
LONG_PKGS := $(filter-out ./cmd/shaper/,$(sort $(dir $(shell grep -rl --include='*_test.go' '^func TestLong' .))))
UNRACED := 'TestLong(StrictSpacing|SpacingVendorRetryAfter|NetworkJitter|ConvergesOnTheTrueLimit|OneAccountsBacklogDelaysNoOther|CostsAgainstAUnitVendor)'
test-long:
	@$(MAKE) --no-print-directory test-long-cli > test-long-cli.txt 2>&1 & cli=$$!; \
	echo "make test-long-cli (beside the next, its output below it)"; \
	$(MAKE) --no-print-directory test-long-race; race=$$?; \
	wait $$cli; clirc=$$?; cat test-long-cli.txt; rm -f test-long-cli.txt; \
	test $$race -eq 0 && test $$clirc -eq 0
	$(MAKE) --no-print-directory test-long-unraced

# The three parts of make test-long, for CI to arrange (see .ci/run).
# Each first builds its test binaries with go test's default parallelism
# (-p is also how many builds run at once: under -p 1 the race build of
# every dependency used one core, 250 of the race run's 522 s on a clean
# clone, 2026-12-07), then runs them one package at a time.
# The unraced scenarios run all at once (-parallel 16): the strict-spacing
# ones alone first (they are not parallel), then the rest side by side,
# where they mostly wait on their vendors.
test-long-cli:
	$(GO) test -count=1 -run '^$$' ./cmd/shaper > /dev/null
	$(GO) test -count=1 -p 1 -parallel 9 -timeout 20m -run '^TestLong' ./cmd/shaper
test-long-race:
	$(GO) test -race -count=1 -run '^$$' $(LONG_PKGS) > /dev/null
	$(GO) test -race -count=1 -p 1 -parallel 9 -timeout 30m -run '^TestLong' -skip $(UNRACED) $(LONG_PKGS)
test-long-unraced:
	$(GO) test -count=1 -run '^$$' ./queue > /dev/null
	$(GO) test -count=1 -p 1 -parallel 16 -timeout 10m -run $(UNRACED) ./queue

# The gate's own speed (BenchmarkReserve) and Redis CPU per grant beside
# redis_rate's GCRA (BenchmarkRedisCPU, redis-µs/grant); enqueueing
# through the HTTP API beside queue.Client.EnqueueBatch (BenchmarkEnqueue:
# calls/s and Redis commands per call, batches of 100; ten runs of both,
# one after the other, so that a busy spell of a shared machine falls on
# both); then the side-by-side benchmark against the alternatives (writes
# docs/bench.md and docs/bench.svg; about 8 minutes).
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count 6 ./shaper | tee bench.txt
	benchstat bench.txt
	for i in 1 2 3 4 5 6 7 8 9 10; do $(GO) test -run '^$$' -bench Enqueue -benchmem -count 1 ./internal/api || exit 1; done | tee bench-api.txt
	benchstat -col /via bench-api.txt
	$(GO) run ./bench -out docs
	$(GO) run ./bench -scale -out docs

# The HTTP API's bar, end to end with real processes (docs/results.md):
# shaper serve and one worker (built by the test), driven by bench/api_bar.py (Python's
# urllib alone, serving the vendor itself): 1,000 calls in one NDJSON
# POST all done, 0 429s, none twice, a second POST queuing nothing, GET
# ?wait= within 100 ms of a call's end. Needs python3; about 10 s.
bench-api:
	$(GO) test -count=1 -v -run '^TestBarFromPython$$' ./internal/api

# The learning figures (docs/learning.md): the simulator's table (the same
# on every machine; TestLearningSimulated also asserts it in make test)
# and the shares the wall-clock scenarios deliver here, which they log but
# do not assert: nine vendors configured at twice their limit, nginx
# limit_req without burst (learned, strict_spacing, a fixed guard), 0-40 ms
# of network jitter, a quiet fixed-window vendor. Without -race, one
# scenario at a time. A missing nginx fails the run. About 3 minutes.
LEARN_RUNS := 'TestLearningSimulated|TestWorkersDrainAtTheRate|TestLong(ConvergesOnTheTrueLimit|StrictSpacing|SpacingVendorRetryAfter|NetworkJitter|QuietHost)'
bench-learn:
	$(GO) test -count=1 -p 1 -parallel 9 -timeout 20m -v -run $(LEARN_RUNS) ./shaper ./queue > learn.txt || (tail -50 learn.txt; exit 1)
	$(GO) run ./bench -learn learn.txt -out docs -learn-command "make bench-learn"

# The order calls start in under load (docs/results.md): 3 workers drain
# 1,500 calls queued in order at 100/s to a fixed-window vendor, steady
# and with the rate edited 100 -> 60 -> 100 and one 429, beside two
# CPU-bound processes (yes, stopped with the run). Asserts safety (no
# vendor window over its limit, no call twice); logs how far calls
# started from their enqueue order. About a minute.
bench-order:
	@yes > /dev/null & a=$$!; yes > /dev/null & b=$$!; \
	$(GO) test -tags orderbar -count=1 -v -run '^TestOrderBar$$' ./queue > order.txt 2>&1; rc=$$?; \
	kill $$a $$b; grep -v '^    worker_test' order.txt; rm -f order.txt; exit $$rc

# Issue 42's export bar (docs/results.md): 2,000 POST calls answered
# with 4 KB JSON bodies through three worker processes at 100/s (fixed
# windows, hidden phase), `shaper export --wait --out answers.ndjson`:
# every answer whole and in order, no window over the limit, and the
# peak resident memory of the CLI and the workers. About 30 s.
bench-export:
	$(GO) test -tags exportbar -count=1 -v -run '^TestExportBar$$' ./cmd/shaper | grep -v '^    .*level='

# What serving 200 idle vendors costs in Redis commands/s, goroutines and
# CPU, beside plain asynq on the same queues (writes docs/idle.md; 1 minute).
bench-idle:
	$(GO) run ./bench -idle -out docs

# docs/ui.png: the live page of a real worker in headless Chromium,
# taken by TestPageInBrowser while calls go out and a 429 pauses them.
ui-screenshot:
	$(GO) test -tags browser -count=1 -run '^TestPageInBrowser$$' -v ./cmd/shaper -args -screenshot $(CURDIR)/docs/ui.png

lint:
	@test -z "$$(gofmt -l .)" || (echo "gofmt needed:"; gofmt -l .; exit 1)
	$(GO) vet ./...
	$(GO) vet -tags browser ./cmd/shaper
	$(GO) vet -tags nginx ./internal/nginxtest
	$(GO) vet -tags examples ./internal/api
	$(GO) vet -tags orderbar ./queue
	$(GO) vet -tags exportbar ./cmd/shaper
	$(STATICCHECK) ./...
	$(STATICCHECK) -tags browser ./cmd/shaper
	$(STATICCHECK) -tags nginx ./internal/nginxtest
	$(STATICCHECK) -tags examples ./internal/api

# A short fuzz run of every parser, as CI runs it: a fixed number of
# inputs (a time budget can end mid-input and fail with "context deadline
# exceeded"), one worker each.
# Its two halves, the user's input (config, call files) and the
# vendor's answers (paths, Retry-After, rate-limit headers), are targets
# of their own so that CI can run them beside its other long steps.
fuzz-short: fuzz-short-input fuzz-short-vendor
fuzz-short-input:
	$(GO) test -run '^$$' -fuzz 'FuzzParse$$' -fuzztime 20000x -parallel 1 ./config
	$(GO) test -run '^$$' -fuzz FuzzParseCalls -fuzztime 20000x -parallel 1 ./queue
fuzz-short-vendor:
	$(GO) test -run '^$$' -fuzz FuzzCheckPath -fuzztime 20000x -parallel 1 ./vendorclients
	$(GO) test -run '^$$' -fuzz FuzzParseRetryAfter -fuzztime 20000x -parallel 1 ./vendorclients
	$(GO) test -run '^$$' -fuzz FuzzParseHints -fuzztime 20000x -parallel 1 ./vendorclients

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
FAULTS := 'Fault|ThreeWorkersAndAKill|TestOwnRedisGateRestart|TestOwnRedisStaleCopy|TestOwnRedisMissingStateAfterSwitch|EvictingRedis|TLSAndLeastPrivilegeACL|WaitsForReplicas|SecretsStayOut|MillionQueuedCalls'
faults:
	$(GO) test -count=1 -p 1 -parallel 4 -timeout 30m -v -run $(FAULTS) ./cmd/shaper ./queue ./shaper
