#!/bin/bash
# cgdiff.sh CASE [toggle]: builds the shaper test binary and prints instructions per grant
case=${1:-accsim}; tog=${2:-fcallCommand}
cd /work/main && cp .plans/zz_cg_test.go.txt shaper/zz_cg_test.go && go test -c -o /tmp/cgd.test ./shaper || exit 1
a=$(bash .plans/cg.sh /tmp/cgd.test $case 0 $tog)
b=$(bash .plans/cg.sh /tmp/cgd.test $case 2000 $tog)
rm -f /work/main/shaper/zz_cg_test.go
echo "$case: $(( (b - a) / 2000 )) instr/grant"
