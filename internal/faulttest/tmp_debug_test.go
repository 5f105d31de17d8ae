package faulttest

import (
	"testing"
	"time"
)

func TestTmpNoFaults(t *testing.T) {
	pool := openPool(t, ApplicationNamePrefix+"-harness", 12)
	s := newSuite(t, pool, buildWorker(t))
	for range 3 {
		s.startWorker()
	}
	stop := s.startProducers()
	time.Sleep(15 * time.Second)
	stop()
	s.drain()
	s.stopAll()
	s.check()
}
