package redistest

import "syscall"

// dieWithParent has the kernel kill a spawned redis-server when the test
// binary that started it dies, even by SIGKILL or a timeout, when its
// Cleanup never runs.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
