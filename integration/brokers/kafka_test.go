package brokers_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/txoutbox/txoutbox"
)

const kafkaPartitions = 6

// newKafkaCluster starts an in-process Kafka (kfake) with topic seeded, on
// port (0: any free port), closed when the test ends.
func newKafkaCluster(t *testing.T, port int, topic string) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(port), kfake.SeedTopics(kafkaPartitions, topic))
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// newKafkaPublisher is the forwarder's target: watermill-kafka's publisher
// with the outbox key as partition key. Short timeouts make a dead broker fail
// a publish quickly instead of hanging it.
func newKafkaPublisher(t *testing.T, brokers []string) *kafka.Publisher {
	t.Helper()
	sc := kafka.DefaultSaramaSyncPublisherConfig()
	sc.Producer.Retry.Max = 2
	sc.Producer.Retry.Backoff = 50 * time.Millisecond
	sc.Producer.Timeout = time.Second
	sc.Metadata.Retry.Max = 1
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	sc.Net.DialTimeout = 500 * time.Millisecond
	sc.Net.ReadTimeout = time.Second
	sc.Net.WriteTimeout = time.Second
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               brokers,
		Marshaler:             kafka.NewWithPartitioningMarshaler(txoutbox.PartitionKey),
		OverwriteSaramaConfig: sc,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("kafka publisher: %v", err)
	}
	t.Cleanup(func() { pub.Close() })
	return pub
}

// kafkaConsumer reads topic from the start with a plain franz-go client, so
// the test sees what any Kafka consumer sees: key, partition, headers.
type kafkaConsumer struct {
	t  *testing.T
	cl *kgo.Client
}

func newKafkaConsumer(t *testing.T, brokers []string, topic string) *kafkaConsumer {
	t.Helper()
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(brokers...),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	)
	if err != nil {
		t.Fatalf("kgo client: %v", err)
	}
	t.Cleanup(cl.Close)
	return &kafkaConsumer{t: t, cl: cl}
}

// read polls until want distinct UUIDs were read, or timeout.
func (c *kafkaConsumer) read(want int, timeout time.Duration) []received {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var got []received
	seen := map[string]bool{}
	for len(seen) < want {
		fetches := c.cl.PollFetches(ctx)
		if ctx.Err() != nil {
			c.t.Errorf("timed out: %d of %d distinct records read from Kafka", len(seen), want)
			return got
		}
		fetches.EachError(func(topic string, p int32, err error) {
			c.t.Logf("fetch %s/%d: %v", topic, p, err)
		})
		fetches.EachRecord(func(r *kgo.Record) {
			rec := received{Key: string(r.Key), Partition: r.Partition, Payload: r.Value, Metadata: map[string]string{}}
			for _, h := range r.Headers {
				if h.Key == kafka.UUIDHeaderKey {
					rec.UUID = string(h.Value)
				} else {
					rec.Metadata[h.Key] = string(h.Value)
				}
			}
			got = append(got, rec)
			seen[rec.UUID] = true
		})
	}
	return got
}

// checkPartitions asserts every key stayed on one partition and the keys
// spread over more than one.
func checkPartitions(t *testing.T, got []received) {
	t.Helper()
	byKey := map[string]int32{}
	used := map[int32]bool{}
	for _, r := range got {
		if p, ok := byKey[r.Key]; ok && p != r.Partition {
			t.Errorf("key %s on partitions %d and %d", r.Key, p, r.Partition)
		}
		byKey[r.Key] = r.Partition
		used[r.Partition] = true
	}
	if len(byKey) > 3 && len(used) < 2 {
		t.Errorf("%d keys all on one partition: is the partition key set?", len(byKey))
	}
}

// TestKafka: producers commit orders and events in one pgx transaction each
// (a fifth roll back); two forwarders relay to Kafka through watermill-kafka
// with the outbox key as partition key; a franz-go consumer reads them back.
func TestKafka(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	topic := uniqueName("orders")
	cluster := newKafkaCluster(t, 0, topic)
	brokers := cluster.ListenAddrs()

	start := time.Now()
	committed, rolledBack := f.produce(t, topic, 4, 5, 50)
	runForwarders(t, f.store, newKafkaPublisher(t, brokers), 2, txoutbox.ForwarderConfig{
		BatchSize: 20, Concurrency: 4, PollMin: 10 * time.Millisecond, PollMax: 100 * time.Millisecond,
	})
	got := newKafkaConsumer(t, brokers, topic).read(len(committed), time.Minute)
	t.Logf("%d committed events (%d rolled back) produced and read back from Kafka in %s", len(committed), len(rolledBack), time.Since(start))

	checkDelivery(t, committed, rolledBack, got)
	checkPartitions(t, got)
}

// TestKafkaBrokerDown: while the cluster is down, for many times the retry
// schedule, the forwarders see the outage (Sarama's errors say the brokers
// are out of reach) and charge the records nothing: none is dead-lettered
// with MaxAttempts 3, nothing is lost, and delivery resumes by itself when a
// cluster is back on the same address.
func TestKafkaBrokerDown(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	topic := uniqueName("orders")

	// Phase 1: the cluster is up.
	first, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(kafkaPartitions, topic))
	if err != nil {
		t.Fatal(err)
	}
	brokers := first.ListenAddrs()
	_, portText, _ := net.SplitHostPort(brokers[0])
	port, _ := strconv.Atoi(portText)

	fwds := runForwarders(t, f.store, newKafkaPublisher(t, brokers), 2, txoutbox.ForwarderConfig{
		BatchSize: 20, Concurrency: 4, PollMin: 10 * time.Millisecond, PollMax: 100 * time.Millisecond,
		MaxAttempts:      3, // the whole schedule is 300 ms: the outage outlasts it many times
		Backoff:          txoutbox.Backoff{Base: 100 * time.Millisecond, Max: 400 * time.Millisecond},
		ProbeInterval:    100 * time.Millisecond,
		ProbeIntervalMax: 400 * time.Millisecond,
		PublishTimeout:   2 * time.Second,
		Lease:            10 * time.Second,
		ShutdownTimeout:  3 * time.Second,
	})
	before, rb1 := f.produce(t, topic, 2, 3, 10)
	consumer := newKafkaConsumer(t, brokers, topic)
	checkDelivery(t, before, rb1, consumer.read(len(before), 30*time.Second))
	consumer.cl.Close()

	// Phase 2: the broker goes away; events keep committing.
	first.Close()
	downAt := time.Now()
	during, rb2 := f.produce(t, topic, 2, 3, 10)
	waitFor(t, 30*time.Second, "a forwarder to see the outage", func() bool {
		for _, fwd := range fwds {
			if errors.Is(fwd.Healthy(), txoutbox.ErrOutage) {
				return true
			}
		}
		return false
	})
	waitFor(t, 30*time.Second, "ten retry schedules to pass", func() bool { return time.Since(downAt) > 3*time.Second })
	var lastErr string
	var maxAttempts, delivered int
	if err := f.pool.QueryRow(context.Background(), fmt.Sprintf(
		`SELECT coalesce(max(last_error), ''), max(attempts), (SELECT count(*) FROM %[1]s.outbox_delivered WHERE uuid = ANY($1)) FROM %[1]s.outbox WHERE uuid = ANY($1)`, f.schema),
		uuids(during)).Scan(&lastErr, &maxAttempts, &delivered); err != nil {
		t.Fatal(err)
	}
	if delivered != 0 {
		t.Errorf("%d records marked delivered while the broker was down", delivered)
	}
	var dead int
	if err := f.pool.QueryRow(context.Background(), fmt.Sprintf(`SELECT count(*) FROM %s.outbox WHERE status = 'dead'`, f.schema)).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	if dead != 0 {
		t.Errorf("%d records dead-lettered during the outage", dead)
	}
	t.Logf("down for %s: max attempts %d, last error %q", time.Since(downAt).Round(time.Millisecond), maxAttempts, lastErr)

	// Phase 3: a broker is back on the same address; nothing to do but wait.
	second := newKafkaCluster(t, port, topic)
	upAt := time.Now()

	got := newKafkaConsumer(t, second.ListenAddrs(), topic).read(len(during), time.Minute)
	t.Logf("%d events committed during the outage delivered %s after the broker came back", len(during), time.Since(upAt).Round(time.Millisecond))
	checkDelivery(t, during, rb2, got)
	checkPartitions(t, got)

	waitFor(t, 10*time.Second, "every record delivered", func() bool {
		var pending int
		// An ack moves the row to outbox_delivered: what is left is pending or dead.
		if err := f.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+f.schema+".outbox").Scan(&pending); err != nil {
			t.Fatal(err)
		}
		return pending == 0
	})
}

func uuids(evs []event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.UUID
	}
	return out
}
