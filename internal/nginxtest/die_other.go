//go:build !linux

package nginxtest

import "syscall"

// dieWithParent: only Linux can tie a child's life to its parent's; the
// harness's Cleanup stops nginx elsewhere.
func dieWithParent() *syscall.SysProcAttr { return nil }
