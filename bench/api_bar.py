#!/usr/bin/env python3
"""The HTTP API's bar, from Python's standard library alone (urllib).

    python3 bench/api_bar.py --api URL --vendor NAME --vendor-listen HOST:PORT [--calls 1000] [--rate 200]

Against `shaper serve` (at URL) and a worker whose config sends vendor
NAME's calls to http://HOST:PORT, where this script serves a vendor of
its own: it allows --rate calls per second in fixed one-second windows
at a random phase (answering 429 with Retry-After: 1 beyond), and counts
each Idempotency-Key. The script then

  1. POSTs --calls calls as NDJSON in one request (202, all queued),
  2. POSTs the same body again at once (202, nothing queued),
  3. holds a GET ?wait=60s on every 50th call, from a thread each, and
     records when each returned,
  4. waits for the vendor to have seen every call, GETs every call (all
     completed with the vendor's 200), POSTs the body a third time
     (nothing queued),

and prints the figures: the vendor's 429s, calls seen twice, the most
calls in one of its windows and in any sliding second, the rate it
received, and how long after the vendor answered each held GET returned.
It exits 0 when every bar holds: all done, 0 429s, none twice, the
second and third POSTs queue nothing, every held GET returned within
100 ms of its call's end. SHAPER_API_TOKEN, when set, is sent as the
bearer token.
"""
import argparse
import bisect
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WAIT_BAR = 0.100  # seconds from the vendor's answer to the held GET's return


class Vendor:
    """A vendor with a limit of rate calls per fixed second at a random phase."""

    def __init__(self, rate):
        self.rate = rate
        self.phase = random.random()
        self.lock = threading.Lock()
        self.windows = {}  # window number -> calls allowed in it
        self.keys = {}  # Idempotency-Key -> times seen (allowed)
        self.answered = {}  # Idempotency-Key -> monotonic time its 200 was sent
        self.starts = []  # monotonic receipt times of allowed calls
        self.refused = 0

    def take(self, key, now):
        w = int(time.time() - self.phase)
        with self.lock:
            if self.windows.get(w, 0) >= self.rate:
                self.refused += 1
                return False
            self.windows[w] = self.windows.get(w, 0) + 1
            self.keys[key] = self.keys.get(key, 0) + 1
            self.starts.append(now)
            return True

    def handler(self):
        vendor = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The headers and the body are two writes: with Nagle's
            # algorithm the body would wait for the worker's delayed ACK
            # (40 ms on Linux) after the time recorded as the answer.
            disable_nagle_algorithm = True

            def do_any(self):
                now = time.monotonic()
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                key = self.headers.get("Idempotency-Key", "")
                if vendor.take(key, now):
                    body = b'{"ok":true}'
                    self.send_response(200)
                else:
                    body = b'{"error":"rate limited"}'
                    self.send_response(429)
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                with vendor.lock:
                    vendor.answered.setdefault(key, time.monotonic())

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_any

            def log_message(self, *args):
                pass

        return Handler

    def max_sliding(self, window=1.0):
        s = sorted(self.starts)
        return max((bisect.bisect_left(s, t + window) - i for i, t in enumerate(s)), default=0)


def request(method, url, body=None, ctype=None, timeout=120):
    req = urllib.request.Request(url, data=body, method=method)
    if ctype:
        req.add_header("Content-Type", ctype)
    if os.environ.get("SHAPER_API_TOKEN"):
        req.add_header("Authorization", "Bearer " + os.environ["SHAPER_API_TOKEN"])
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--api", required=True, help="the API's base URL, e.g. http://127.0.0.1:8081")
    ap.add_argument("--vendor", required=True, help="the vendor's name in the config")
    ap.add_argument("--vendor-listen", required=True, help="HOST:PORT the config's base_url names")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rate", type=int, default=200, help="the vendor's limit per second")
    ap.add_argument("--timeout", type=float, default=120, help="seconds for every call to reach the vendor")
    a = ap.parse_args()
    api = a.api.rstrip("/")

    vendor = Vendor(a.rate)
    host, port = a.vendor_listen.rsplit(":", 1)
    srv = ThreadingHTTPServer((host, int(port)), vendor.handler())
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    run = str(int(time.time() * 1000))
    ids = [f"bar-{run}-{i:04d}" for i in range(a.calls)]
    body = "".join(json.dumps({"vendor": a.vendor, "id": i, "method": "POST", "path": "/orders", "body": {"n": n}}) + "\n"
                   for n, i in enumerate(ids)).encode()
    failures = []

    t0 = time.monotonic()
    status, first = request("POST", api + "/v1/calls", body, "application/x-ndjson")
    posted = time.monotonic() - t0
    if status != 202 or first.get("enqueued") != a.calls or first.get("ids") != ids:
        sys.exit(f"first POST: {status} {str(first)[:300]}: want 202 with {a.calls} queued, the ids in order")
    status, second = request("POST", api + "/v1/calls", body, "application/x-ndjson")
    if status != 202 or second.get("enqueued") != 0 or second.get("already_queued") != a.calls:
        failures.append(f"second POST: {status} enqueued={second.get('enqueued')} already_queued={second.get('already_queued')}: want nothing queued")

    held = ids[::50]
    returned = {}

    def hold(i):
        st, e = request("GET", f"{api}/v1/calls/{i}?wait=60s")
        returned[i] = (time.monotonic(), st, e.get("state"), e.get("status"))

    threads = [threading.Thread(target=hold, args=(i,)) for i in held]
    for th in threads:
        th.start()

    deadline = time.monotonic() + a.timeout
    while True:
        with vendor.lock:
            seen = len(vendor.keys)
        if seen >= a.calls or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    done_at = time.monotonic()
    for th in threads:
        th.join(timeout=70)

    def state(i):
        return request("GET", f"{api}/v1/calls/{i}")

    with ThreadPoolExecutor(8) as pool:
        states = list(pool.map(state, ids))
    completed = sum(1 for st, e in states if st == 200 and e.get("state") == "completed" and e.get("status") == 200)
    status, third = request("POST", api + "/v1/calls", body, "application/x-ndjson")
    srv.shutdown()

    with vendor.lock:
        twice = sorted(k for k, n in vendor.keys.items() if n > 1)
        unknown = sorted(set(vendor.keys) - set(ids))
        missing = [i for i in ids if i not in vendor.keys]
        lags = []
        for i in held:
            at, st, s, code = returned.get(i, (None, None, None, None))
            if at is None or s != "completed" or i not in vendor.answered:
                failures.append(f"GET {i}?wait=60s: {st} {s}: want it completed")
                continue
            lags.append((at - vendor.answered[i], i))
        span = max(vendor.starts) - min(vendor.starts) if vendor.starts else 0
        figures = {
            "calls": a.calls,
            "first_post_seconds": round(posted, 3),
            "second_post_enqueued": second.get("enqueued"),
            "third_post_enqueued": third.get("enqueued"),
            "completed": completed,
            "vendor_calls": sum(vendor.keys.values()),
            "vendor_429s": vendor.refused,
            "seen_twice": len(twice),
            "vendor_limit_per_second": a.rate,
            "most_in_a_vendor_window": max(vendor.windows.values(), default=0),
            "most_in_a_sliding_second": vendor.max_sliding(),
            "calls_per_second_at_the_vendor": round((len(vendor.starts) - 1) / span, 1) if span else 0,
            "all_done_seconds_after_first_post": round(done_at - t0, 2),
            "held_gets": len(lags),
            "wait_return_after_call_end_ms": {
                "median": round(1000 * statistics.median(l for l, _ in lags), 1) if lags else None,
                "max": round(1000 * max(l for l, _ in lags), 1) if lags else None,
                "min": round(1000 * min(l for l, _ in lags), 1) if lags else None,
            },
        }
    if missing:
        failures.append(f"{len(missing)} calls never reached the vendor, e.g. {missing[:3]}")
    if unknown:
        failures.append(f"the vendor saw {len(unknown)} keys it was not sent, e.g. {unknown[:3]}")
    if completed != a.calls:
        failures.append(f"{completed} of {a.calls} calls completed with the vendor's 200")
    if vendor.refused:
        failures.append(f"the vendor answered {vendor.refused} calls 429")
    if twice:
        failures.append(f"{len(twice)} calls reached the vendor twice, e.g. {twice[:3]}")
    if status != 202 or third.get("enqueued") != 0:
        failures.append(f"third POST, every call done: {status} enqueued={third.get('enqueued')}: want nothing queued")
    for lag, i in lags:
        if lag > WAIT_BAR:
            failures.append(f"GET {i}?wait= returned {1000 * lag:.1f} ms after the vendor answered it (bar: {1000 * WAIT_BAR:.0f} ms)")
    print(json.dumps(figures, indent=2))
    for f in failures:
        print("FAIL:", f)
    print("bar met" if not failures else f"bar not met: {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
