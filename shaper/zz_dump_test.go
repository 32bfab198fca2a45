package shaper

import (
	"os"
	"testing"
)

func TestZZDump(t *testing.T) {
	os.WriteFile("/tmp/mb/core.lua", []byte(codesLua+fmtLua+nowFromLua+extendLua+rollLua+spacingLua+lineFieldLua+lineLua+coreLua), 0o644)
}
