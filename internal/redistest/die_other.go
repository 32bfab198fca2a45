//go:build !linux

package redistest

import "syscall"

// dieWithParent: only Linux can tie a child's life to its parent's; a
// test binary killed mid-run may leave its redis-server behind.
func dieWithParent() *syscall.SysProcAttr { return nil }
