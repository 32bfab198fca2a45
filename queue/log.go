package queue

import (
	"log/slog"
)

// problemLog logs a failing operation once when it starts failing and
// once when it works again, not on every attempt. It is used by one
// goroutine.
type problemLog struct {
	log     *slog.Logger
	health  *redisHealth // Redis being unavailable is its to log
	failing map[string]bool
}

func newProblemLog(l *slog.Logger, health *redisHealth) *problemLog {
	return &problemLog{log: l, health: health, failing: map[string]bool{}}
}

// check records the outcome of what (a fixed set of operations per
// owner, so the map stays small).
func (p *problemLog) check(what string, err error, args ...any) {
	switch {
	case err != nil && !p.failing[what] && p.health != nil && p.health.quiet(err):
		// An outage: logged once by the worker's health, not here.
	case err != nil && !p.failing[what]:
		p.failing[what] = true
		p.log.Warn(what+" failed; retrying quietly until it works", append(args, "err", err)...)
	case err == nil && p.failing[what]:
		delete(p.failing, what)
		p.log.Info(what+" works again", args...)
	}
}
