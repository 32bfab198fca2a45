package shaper

import (
	"os"
	"testing"
)

func TestZZDump(t *testing.T) {
	for name, txt := range luaTexts() {
		os.WriteFile("/tmp/lua_"+name+".lua", []byte(txt), 0o644)
	}
}
