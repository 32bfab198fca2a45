package shaper

import (
	"context"
	"errors"
	"io"
	"testing"
)

// TestUnavailableWraps: the gate's errors that say Redis cannot answer
// for now wrap ErrUnavailable and the error itself (redisonce's
// TestUnavailable tells which errors say so); a caller's own ended
// context is not Redis being unavailable.
func TestUnavailableWraps(t *testing.T) {
	err := unavailable(context.Background(), io.EOF)
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, io.EOF) {
		t.Errorf("unavailable(EOF) = %v: want it to wrap ErrUnavailable and EOF", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := unavailable(ctx, io.EOF); errors.Is(err, ErrUnavailable) {
		t.Errorf("a caller's own ended context is not Redis being unavailable: %v", err)
	}
}
