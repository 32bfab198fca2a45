package queue

import (
	"fmt"
	"log/slog"
)

// asynqLogger sends asynq's logs to slog.
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...)) }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...)) }
func (a asynqLogger) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...)) }
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...)) }
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...)) }

// problemLog logs a failing operation once when it starts failing and
// once when it works again, not on every attempt. It is used by one
// goroutine.
type problemLog struct {
	log     *slog.Logger
	failing map[string]bool
}

func newProblemLog(l *slog.Logger) *problemLog {
	return &problemLog{log: l, failing: map[string]bool{}}
}

// check records the outcome of what (a fixed set of operations per
// owner, so the map stays small).
func (p *problemLog) check(what string, err error, args ...any) {
	switch {
	case err != nil && !p.failing[what]:
		p.failing[what] = true
		p.log.Warn(what+" failed; retrying quietly until it works", append(args, "err", err)...)
	case err == nil && p.failing[what]:
		delete(p.failing, what)
		p.log.Info(what+" works again", args...)
	}
}
