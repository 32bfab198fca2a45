package nginxtest

import "syscall"

// dieWithParent has the kernel kill the nginx a harness started when the
// test binary dies, even by SIGKILL or a timeout, when its Cleanup never
// runs (nginx runs in the foreground, one process: daemon and
// master_process off).
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
