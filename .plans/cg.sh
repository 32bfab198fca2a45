#!/bin/bash
# cg.sh BIN CASE N TOGGLE -> instructions collected
bin=$1; case=$2; n=$3; toggle=$4
port=$((6400 + RANDOM % 500))
rm -f /tmp/cg.out.*
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=$toggle --callgrind-out-file=/tmp/cg.out.%p redis-server --port $port --save "" --appendonly no >/dev/null 2>&1 &
vp=$!
for i in $(seq 100); do redis-cli -p $port ping >/dev/null 2>&1 && break; sleep 0.2; done
(cd /work/main/shaper && CG_ADDR=127.0.0.1:$port CG_CASE=$case CG_N=$n $bin -test.run TestZZCallgrind >/dev/null 2>&1)
redis-cli -p $port shutdown nosave >/dev/null 2>&1
wait $vp 2>/dev/null
grep -h "^summary:\|^totals:" /tmp/cg.out.* | head -1 | awk '{print $2}'
