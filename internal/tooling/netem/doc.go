// Package netem shapes the network between the prefill and the decode
// side of a benchmark: `kvflow bench e2e --netem "delay 1ms"` runs the
// prefill workers in one Linux network namespace and the decode workers
// in another, so every byte between them crosses an emulated link with
// the requested delay, and nothing else on the machine is affected.
//
// Setup creates the two namespaces (kvP-<id> and kvD-<id>) and chooses
// one of three ways, in this order, automatically unless Options.Mode
// forces one:
//
//   - kernel netem: a veth pair joins the namespaces (10.199.0.1/30 in
//     prefill, 10.199.0.2/30 in decode) and `tc qdisc add dev <veth>
//     root netem <spec>` runs on both ends, so the round trip is twice
//     the delay. Workers bind to PrefillAddr / DecodeAddr.
//   - netfilter queue delay, when the kernel has no sch_netem but has
//     nfnetlink_queue and iptables(8) is installed: the same veth pair,
//     and in each namespace an iptables rule (INPUT, -i the veth, -j
//     NFQUEUE) hands every arriving packet to netfilter queue 0, where
//     it waits until this process accepts it, no earlier than delay
//     (plus jitter, never reordered) after it was queued. Only packet
//     ids cross to this process (copy mode meta; GSO packets whole), and
//     one batch verdict accepts every packet due. Held on arrival rather
//     than on the way out, packets no longer count against the sender's
//     TCP small-queue limit, as with netem's own qdisc. Like netem, every
//     packet is delayed, SYN and ACK included, so TCP sees the round
//     trip. Only "delay D [J]" is emulated.
//   - userspace delay relay, when neither is there ("Error:
//     Specified qdisc kind is unknown."): the namespaces have only lo, no
//     link between them. For each port named to Relay, this process
//     listens on 127.0.0.1:<port> inside the decode namespace and
//     forwards every accepted connection to 127.0.0.1:<port> inside the
//     prefill namespace through a delay line in each direction: a chunk
//     read at time t is written to the other side no earlier than t +
//     delay (plus uniform jitter if asked), in order, with a bounded
//     number of bytes in flight. Decode workers reach prefill at the same
//     127.0.0.1:<port> address prefill advertises, so no configuration
//     changes. Bytes are spliced (socket to pipe, held there, pipe to
//     socket), never copied through the relay's memory: the emulated
//     link should cost the benchmark's cores as little as a qdisc would
//     (a copying line remains for connections that are not TCP). Only "delay D [J]" is emulated; anything else is refused
//     with an error naming what is unsupported. Differences from netem:
//     the TCP handshake is not delayed (connect returns once the relay
//     accepts; only bytes and FIN are), jitter never reorders (a chunk
//     waits for the one before it, so the mean delay rises a little),
//     per-connection throughput is at most about RelayBuffer/delay, and
//     the relay's own timer latency adds to the delay (the delay is a
//     lower bound, never shortened).
//
// Sockets are made inside a namespace (Listen, DialContext) on a locked
// OS thread that enters the namespace with setns(2) and goes back before
// it is unlocked (or is thrown away locked when going back fails), so no
// other goroutine ever runs in a foreign namespace. Processes run inside
// a namespace through Command (`ip netns exec`).
//
// What the package must never do: touch an interface, address, route or
// qdisc outside the namespaces it created (the veth pair is created
// directly inside them and never exists in the caller's namespace); run
// a shell (ip and tc are exec'd with argument vectors, and a netem spec
// is split into simple tokens that are checked first); leave a namespace
// behind after Close (Close is idempotent and also undoes a partial
// Setup; Setup removes stale namespaces of the same ID, and Cleanup
// removes those a crashed run left).
package netem
