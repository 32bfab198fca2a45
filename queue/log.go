package queue

import (
	"log/slog"
	"time"

	"github.com/shaper-dev/shaper/shaper"
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

// waitLog logs a vendor's long wait as a state: once when it begins, once
// when its kind changes and once when it ends, however often the queue is
// paused and unpaused meanwhile. (A backlogged vendor's queue is unpaused
// when its next free tick nears and paused again as soon as the calls it
// lets through reach beyond max_wait: every half second, per replica.)
// The kinds are "backlogged" (the next free tick is beyond max_wait) and
// "paused" (a pause the vendor asked for). A state ends once the queue has
// stayed unpaused until every call a pause sent back has come back: a call
// sent back for a wait W returns within W + back (asynq's whole-second
// retry schedule and its forwarder's poll), and the next free tick seen
// while the queue is paused bounds W. Time is the caller's (now). It is
// used by the vendor's supervisor goroutine only.
type waitLog struct {
	log     *slog.Logger
	maxWait time.Duration
	back    time.Duration
	kind    string    // "" (no long wait), "backlogged" or "paused"
	until   time.Time // when the calls sent back have all come back
}

// paused records that the vendor's queue is paused at now, and st, the
// vendor's gate then.
func (l *waitLog) paused(now time.Time, st shaper.Stats) {
	kind := "backlogged"
	if st.PausedFor > 0 {
		kind = "paused"
	}
	if back := now.Add(st.NextTick + l.back); back.After(l.until) {
		l.until = back
	}
	if kind == l.kind {
		return
	}
	l.kind = kind
	args := []any{"next_tick", st.NextTick.Round(time.Millisecond), "max_wait", l.maxWait}
	if kind == "paused" {
		l.log.Info("vendor paused beyond max_wait: its queue is paused until the pause nearly ends", append(args, "reason", st.PauseReason)...)
		return
	}
	l.log.Info("vendor backlogged: its next free tick is beyond max_wait, so its queue is paused while the tick is far, until the backlog clears", args...)
}

// running records that the vendor's queue is not paused at now.
func (l *waitLog) running(now time.Time) {
	if l.kind == "" || now.Before(l.until) {
		return
	}
	if l.kind == "paused" {
		l.log.Info("vendor's pause is over: the calls its queue sent back have come back without a new pause")
	} else {
		l.log.Info("vendor no longer backlogged: the calls its queue sent back have come back without a new pause")
	}
	l.kind, l.until = "", time.Time{}
}
