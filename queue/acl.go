package queue

import (
	"strings"

	"github.com/shaper-dev/shaper/shaper"
)

// ACLRules returns the Redis ACL rules (for ACL SETUSER, or a users.acl
// file line after "user NAME on >PASSWORD") that let shaper's enqueue,
// worker and stats run and nothing more: asynq's keys and channels
// (asynq:*) and shaper's under keyPrefix, the read, write, scripting,
// Pub/Sub, transaction and connection commands without the dangerous
// ones (FLUSHALL, KEYS, CONFIG, DEBUG, ...), plus INFO (the eviction
// check, the gate's failover check), TIME (the gate's clock, in its
// scripts) and MEMORY USAGE (asynq's queue stats).
// TestOwnRedisTLSAndLeastPrivilegeACL (cmd/shaper) runs a worker, enqueue and
// stats as a user with exactly these rules and fails on any ACL denial;
// asynq's recoverer (once a minute), queue pauses and exports are not
// exercised there.
func ACLRules(keyPrefix string) string {
	if keyPrefix == "" {
		keyPrefix = shaper.DefaultKeyPrefix
	}
	return strings.Join([]string{
		"resetkeys", "~asynq:*", "~" + keyPrefix + ":*",
		"resetchannels", "&asynq:*", "&" + keyPrefix + ":*",
		"-@all", "+@read", "+@write", "+@scripting", "+@pubsub", "+@transaction", "+@connection",
		"-@dangerous", "-function|flush", "-function|delete", "-function|restore", "+info", "+time", "+memory|usage",
	}, " ")
}
