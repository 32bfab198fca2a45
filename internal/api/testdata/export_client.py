#!/usr/bin/env python3
"""An export over shaper's HTTP API, from Python's standard library alone.

    python3 export_client.py --api URL --vendor NAME [--calls 2000] [--answer-bytes 4096] [--id ID]

The vendor NAME must answer as `shaper mock-vendor --answer-bytes N` does
(internal/vendorsim.Answer): a JSON body of exactly N bytes,

    {"id":KEY,"method":M,"path":P,"request_sha256":HEX,"waybill":"WB-...","pad":"xxx..."}

where KEY is the request's Idempotency-Key (the call's id), HEX the
SHA-256 of the request's body and the waybill "WB-" and the first 12 hex
digits, upper case, of the key's SHA-256. The script

  1. POSTs --calls calls as NDJSON to /v1/exports?vendor=NAME&id=ID
     (201, every call queued),
  2. follows GET /v1/exports/ID/results?follow=true line by line until
     the stream ends, checking that the lines come in the body's order,
     each done with the vendor's 2xx and its answer's body equal, byte for
     byte, to the body the vendor sent for that call (recomputed here),
  3. GETs /v1/exports/ID (finished, every call done), and POSTs the same
     body again (200, nothing queued twice),

and prints what it saw. It exits 0 when every check holds. With
SHAPER_API_TOKEN set, it sends it as the bearer token.
"""
import argparse
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


def compact(v):
    """JSON as Go's encoding/json writes it (for ASCII without <, >, &)."""
    return json.dumps(v, separators=(",", ":"))


def vendor_answer(method, path, key, body, n):
    """internal/vendorsim.Answer: the body the vendor sends."""
    a = {
        "id": key,
        "method": method,
        "path": path,
        "request_sha256": hashlib.sha256(body).hexdigest(),
        "waybill": "WB-" + hashlib.sha256(key.encode()).hexdigest()[:12].upper(),
        "pad": "",
    }
    b = compact(a)
    if len(b) < n:
        a["pad"] = "x" * (n - len(b))
        b = compact(a)
    return b.encode()


def request(method, url, body=None, ctype=None):
    req = urllib.request.Request(url, data=body, method=method)
    if ctype:
        req.add_header("Content-Type", ctype)
    if os.environ.get("SHAPER_API_TOKEN"):
        req.add_header("Authorization", "Bearer " + os.environ["SHAPER_API_TOKEN"])
    try:
        return urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        return e  # an HTTPError is a response too: its status and body


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--api", required=True, help="the API's base URL, e.g. http://127.0.0.1:8081")
    p.add_argument("--vendor", required=True)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--answer-bytes", type=int, default=4096)
    p.add_argument("--id", default="py-export-%d" % (time.time() * 1000))
    a = p.parse_args()
    api = a.api.rstrip("/")
    q = urllib.parse.urlencode({"vendor": a.vendor, "id": a.id})
    ok = True

    # The calls: every other one with an id of its own, the others get
    # "<export id>:<n>", their place in the export.
    calls = []
    for n in range(1, a.calls + 1):
        call = {"method": "POST", "path": "/orders/%d" % n, "body": {"order": n, "sku": "X-%d" % (n % 7), "qty": n % 5 + 1}}
        if n % 2 == 0:
            call["id"] = "%s-order-%d" % (a.id, n)
        calls.append(call)
    ids = [c.get("id", "%s:%d" % (a.id, n)) for n, c in enumerate(calls, 1)]
    expected = [vendor_answer(c["method"], c["path"], key, compact(c["body"]).encode(), a.answer_bytes) for c, key in zip(calls, ids)]
    body = "".join(compact(c) + "\n" for c in calls).encode()

    start = time.monotonic()
    r = request("POST", api + "/v1/exports?" + q, body, "application/x-ndjson")
    posted = json.load(r)
    print("POST /v1/exports: %d, export %s: %s calls (enqueued %s, already queued %s), Location %s, in %.2f s" % (
        r.status, posted.get("id"), posted.get("total"), posted.get("enqueued"), posted.get("already_queued"),
        r.headers.get("Location"), time.monotonic() - start))
    if r.status != 201 or posted.get("enqueued") != a.calls:
        sys.exit("the POST did not queue every call: %s" % posted)

    # Follow the results: one line per call, in the body's order, as the
    # calls end.
    follow_start = time.monotonic()
    r = request("GET", "%s/v1/exports/%s/results?follow=true" % (api, urllib.parse.quote(a.id, safe="")))
    if r.status != 200 or r.headers.get_content_type() != "application/x-ndjson":
        sys.exit("GET results: %d %s %s" % (r.status, r.headers.get("Content-Type"), r.read()[:500]))
    lines = in_order = equal = 0
    first = None
    bad = []
    for raw in r:  # each line as it arrives
        line = json.loads(raw)
        i = lines
        lines += 1
        if first is None:
            first = time.monotonic() - follow_start
            e = json.load(request("GET", "%s/v1/exports/%s" % (api, urllib.parse.quote(a.id, safe=""))))
            print("first line after %.2f s, while the export was %s (%d of %d done)" % (first, e["state"], e["done"], e["total"]))
        if i < len(ids) and line["id"] == ids[i]:
            in_order += 1
        else:
            bad.append("line %d: id %s, want %s" % (lines, line["id"], ids[i] if i < len(ids) else "no more lines"))
            continue
        ans = line.get("answer") or {}
        got = compact(ans.get("body")).encode() if "body" in ans else None
        status = line.get("status") or 0
        if line["state"] == "done" and 200 <= status < 300 and ans.get("status") == status and got == expected[i] and ans.get("bytes") == len(expected[i]) and not ans.get("cut"):
            equal += 1
        else:
            bad.append("line %d (%s): state %s, status %s, %s body bytes (want %d), cut %s, equal %s" % (
                lines, line["id"], line["state"], line.get("status"), ans.get("bytes"), len(expected[i]), ans.get("cut", False), got == expected[i]))
    elapsed = time.monotonic() - follow_start
    print("read %d lines in %.2f s: %d in the body's order, %d answers equal to what the vendor sent, %d not" % (
        lines, elapsed, in_order, equal, lines - equal))
    for b in bad[:10]:
        print("  " + b)
    ok = ok and lines == a.calls and in_order == a.calls and equal == a.calls

    e = json.load(request("GET", "%s/v1/exports/%s" % (api, urllib.parse.quote(a.id, safe=""))))
    print("GET /v1/exports/%s: %s, %d done, %d failed of %d" % (a.id, e["state"], e["done"], e["failed"], e["total"]))
    ok = ok and e["state"] == "finished" and e["done"] == a.calls and e["failed"] == 0

    r = request("POST", api + "/v1/exports?" + q, body, "application/x-ndjson")
    again = json.load(r)
    print("POST the same body again: %d, enqueued %s, already queued %s" % (r.status, again.get("enqueued"), again.get("already_queued")))
    ok = ok and r.status == 200 and again.get("enqueued") == 0 and again.get("already_queued") == a.calls

    print("%s: %d of %d answers match, in %.2f s from the POST" % ("OK" if ok else "FAILED", equal, a.calls, time.monotonic() - start))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
