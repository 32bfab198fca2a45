// Package shaper is the gate: it lets calls to a vendor start on a
// fixed tick shared by every process on the same Redis, so that the vendor
// sees an even stream just under its limit.
//
// # Guarantees
//
// For a bucket shaped by a Policy, the calls started through every Gate on
// one Redis never exceed a limit's Rate in any interval of its Window,
// whatever the vendor window's phase: at first use, after idle periods,
// after a process or Redis restart, across policy changes and pauses. A
// caller starts within the policy's Tolerance of its tick or not at all.
// With a backlog the ticks are used: no catch-up burst, no lost ticks.
// Each grant costs one Redis round trip, and a bucket's state in Redis is
// a few small keys whatever its backlog.
//
// # Glossary
//
// The words below mean one thing each, here and in every name, log line,
// metric and JSON field of shaper.
//
//   - bucket: what one set of limits applies to (today a vendor). Its state
//     lives in Redis under keys that share the bucket's hash tag.
//   - tick: a moment at which up to Burst calls of a bucket may start. Ticks
//     are Redis time; consecutive ticks are one interval apart.
//   - grant: the gate reserves a tick for one caller (one round trip).
//   - defer: the gate tells a caller to ask again later (its tick would be
//     beyond the horizon, or the in-flight cap is full). Not an error.
//   - start: a caller starts its call at its granted tick, within
//     Tolerance. A caller that wakes later, or whose bucket was paused after
//     the grant, gives the tick up and asks again.
//   - permit: the right to start one call now, returned by Acquire; Release
//     it when the call has finished (it frees the in-flight slot).
//   - pause: no tick of the bucket before a moment, for every process (a
//     429 with Retry-After).
//   - effective rate: the rate the gate spaces ticks by now; the configured
//     rate, or lower when adaptation (Control) lowered it.
//   - rate-limited answer: the vendor answered 429 (or 503 with
//     Retry-After).
//
// # Use
//
// Callers need a Gate, a Bucket, Acquire and Permit.Release. The
// adaptation loop (pauses, announced and learned rates, replica
// heartbeats) works through the narrower Control of a bucket.
package shaper
