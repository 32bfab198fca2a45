#!/usr/bin/env python3
"""Queue calls through shaper's HTTP API, cancel one, follow another.

    python3 api_example.py [BASE_URL [VENDOR]]

BASE_URL defaults to $SHAPER_URL, else http://127.0.0.1:8081; VENDOR to
$SHAPER_VENDOR, else acme. When the API needs a token, it is read from
$SHAPER_API_TOKEN. Needs requests (Debian: python3-requests).
"""
import json
import os
import sys
import time
from urllib.parse import quote

import requests

base = (sys.argv[1] if len(sys.argv) > 1 else os.environ.get("SHAPER_URL", "http://127.0.0.1:8081")).rstrip("/")
vendor = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("SHAPER_VENDOR", "acme")
api = requests.Session()
if os.environ.get("SHAPER_API_TOKEN"):
    api.headers["Authorization"] = "Bearer " + os.environ["SHAPER_API_TOKEN"]

# POST three calls as NDJSON, one per line. Their ids make the POST
# idempotent: the same lines posted again queue nothing twice.
run = str(int(time.time() * 1000))
calls = [{"vendor": vendor, "id": f"example-{run}-{n}", "method": "POST", "path": "/orders", "body": {"n": n}} for n in (1, 2, 3)]
r = api.post(base + "/v1/calls", data="".join(json.dumps(c) + "\n" for c in calls),
             headers={"Content-Type": "application/x-ndjson"})
if r.status_code == 429:
    sys.exit(f"the queue is full: try again in {r.headers['Retry-After']} s")
if r.status_code != 202:
    sys.exit(f"POST refused: {r.status_code} {r.text}")  # {"error": ..., "lines": [{"line": 2, "error": ...}]}
ids = r.json()["ids"]
print(f"queued {len(ids)} calls: {' '.join(ids)}")

# DELETE the last one: 200 if it had not started, 409 once it has.
r = api.delete(f"{base}/v1/calls/{quote(ids[-1], safe='')}")
if r.status_code == 200:
    print(f"cancelled {ids[-1]} while {r.json()['state']}")
else:
    print(f"not cancelled: {r.status_code} {r.json()['error']}")

# GET the first with ?wait=: the answer comes once it has ended (or after 30 s).
r = api.get(f"{base}/v1/calls/{quote(ids[0], safe='')}", params={"wait": "30s"})
r.raise_for_status()
call = r.json()
print(f"{ids[0]} {call['state']}, HTTP {call.get('status')}: {call['reason']}")
sys.exit(0 if call["state"] == "completed" else 1)
