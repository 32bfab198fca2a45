#!/bin/bash
# cg-micro.sh 'LUA BODY'       -> Redis instructions of BODY, run 10000 times in one EVAL (an empty loop's cost included)
# cg-micro.sh eval NKEYS NARGS -> Redis instructions of one EVALSHA of 'return 1' with NKEYS keys and NARGS arguments
# Both count with callgrind on a redis-server of their own (see docs/limits.md).
mkdir -p /tmp/cgmicro && rm -f /tmp/cgmicro/cg.*
port=$((6900 + RANDOM % 90))
toggle=evalCommand
[ "$1" = eval ] && toggle=evalShaCommand
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=$toggle --callgrind-out-file=/tmp/cgmicro/cg.%p \
  redis-server --port $port --save "" --appendonly no >/dev/null 2>&1 &
vp=$!
for i in $(seq 100); do redis-cli -p $port ping >/dev/null 2>&1 && break; sleep 0.2; done
if [ "$1" = eval ]; then
  sha=$(redis-cli -p $port script load "return 1")
  keys=""; for i in $(seq $2); do keys="$keys {x}:somewhat-long-key-name-$i"; done
  args=""; for i in $(seq $3); do args="$args 1733612345678901|1000|2000|300000|x"; done
  redis-benchmark -p $port -n 5000 -c 1 -q evalsha $sha $2 $keys $args >/dev/null 2>&1
  per=5000
else
  # A gate hash's, a counter's and a total's fields, in layout 4 and packed.
  redis-cli -p $port hset h 'q.2:sum' 123 'q.2:low' 456789 'q.2:top' 456790 'q.2:fill' 0 'q.2:456790' 77 'q.2:slot' 60000000 last 1733612345678901 n 3 run abcdef0123456789abcdef0123456789abcdef01 kept 1733612345678901 blocked 0 share 10000 share_at 1733612345678901 >/dev/null
  redis-cli -p $port eval "redis.call('HSET', 'h', 'tl', struct.pack('<dddddddd', 1,2,3,4,5,6,7,8), 'gl', struct.pack('<dddddddddddd', 1,2,3,4,5,6,7,8,9,10,11,12), 'cl', struct.pack('<dddd',1,2,3,4), 'line', struct.pack('<dddddddd', 1,2,3,4,5,6,7,8), 'vt', '1733612345678901', 'log', '1733612345678901', 'asked_at', '1733612345678901', 'asked_rate', '5', 'defer_at', '1733612345678901', 'adapted', '1', 'wide', 'x', 'wide_at', '1733612345678901') return 1" 0 >/dev/null
  redis-cli -p $port eval "local x = 0 for i = 1, 10000 do $1 end return 1" 0 >/dev/null
  redis-cli -p $port eval "local x = 0 for i = 1, 10000 do end return 1" 0 >/dev/null
  per=10000
fi
redis-cli -p $port shutdown nosave >/dev/null 2>&1
wait $vp 2>/dev/null
callgrind_annotate /tmp/cgmicro/cg.* 2>/dev/null | grep -m1 "PROGRAM TOTALS" | awk -v per=$per '{gsub(",","",$1); print int($1/per)}'
