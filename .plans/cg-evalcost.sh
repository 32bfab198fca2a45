#!/bin/bash
# evalcost.sh NKEYS NARGS -> instructions per EVALSHA of 'return 1'
mkdir -p /tmp/cgmicro
port=$((6950 + RANDOM % 40))
rm -f /tmp/cgmicro/ev.*
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=evalShaCommand --callgrind-out-file=/tmp/cgmicro/ev.%p redis-server --port $port --save "" --appendonly no >/dev/null 2>&1 &
vp=$!
for i in $(seq 100); do redis-cli -p $port ping >/dev/null 2>&1 && break; sleep 0.2; done
sha=$(redis-cli -p $port script load "return 1")
keys=""; for i in $(seq $1); do keys="$keys {x}:somewhat-long-key-name-$i"; done
args=""; for i in $(seq $2); do args="$args 1733612345678901|1000|2000|300000|x"; done
redis-benchmark -p $port -n 5000 -c 1 -q evalsha $sha $1 $keys $args >/dev/null 2>&1
redis-cli -p $port shutdown nosave >/dev/null 2>&1
wait $vp 2>/dev/null
callgrind_annotate /tmp/cgmicro/ev.* 2>/dev/null | grep -m1 "PROGRAM TOTALS" | awk '{gsub(",","",$1); print int($1/5000)}'
