#!/bin/bash
# run.sh 'LUA BODY' -> instructions of EVAL with body executed 10000 times minus empty loop
mkdir -p /tmp/cgmicro
port=$((6900 + RANDOM % 50))
rm -f /tmp/cgmicro/cg.*
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=evalCommand --callgrind-out-file=/tmp/cgmicro/cg.%p redis-server --port $port --save "" --appendonly no >/dev/null 2>&1 &
vp=$!
for i in $(seq 100); do redis-cli -p $port ping >/dev/null 2>&1 && break; sleep 0.2; done
redis-cli -p $port hset h 'q.2:sum' 123 'q.2:low' 456789 'q.2:top' 456790 'q.2:fill' 0 'q.2:456790' 77 'q.2:slot' 60000000 last 1733612345678901 n 3 run abcdef0123456789abcdef0123456789abcdef01 kept 1733612345678901 blocked 0 share 10000 share_at 1733612345678901 >/dev/null
redis-cli -p $port eval "redis.call('HSET', 'h', 'tl', struct.pack('<dddddddd', 1,2,3,4,5,6,7,8), 'gl', struct.pack('<dddddddddddd', 1,2,3,4,5,6,7,8,9,10,11,12), 'cl', struct.pack('<dddd',1,2,3,4), 'line', struct.pack('<dddddddd', 1,2,3,4,5,6,7,8), 'vt', '1733612345678901', 'log', '1733612345678901', 'asked_at', '1733612345678901', 'asked_rate', '5', 'defer_at', '1733612345678901', 'adapted', '1', 'wide', 'x', 'wide_at', '1733612345678901') return 1" 0 >/dev/null
redis-cli -p $port eval "local x = 0 for i = 1, 10000 do $1 end return 1" 0 >/dev/null
redis-cli -p $port eval "local x = 0 for i = 1, 10000 do end return 1" 0 >/dev/null
redis-cli -p $port shutdown nosave >/dev/null 2>&1
wait $vp 2>/dev/null
callgrind_annotate /tmp/cgmicro/cg.* 2>/dev/null | grep -m1 "PROGRAM TOTALS" | awk '{gsub(",","",$1); print int($1/10000)}'
