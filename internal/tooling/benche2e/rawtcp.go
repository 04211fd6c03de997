package benche2e

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// RawTCP is the loopback ceiling measured in the same run: total bytes
// streamed over conns Go TCP connections in 1 MiB writes from a 64 MiB
// buffer, read straight into another, no framing. It returns GB/s.
func RawTCP(total int64, conns int) (float64, error) {
	const chunk, buf = 1 << 20, 64 << 20
	src, dst := make([]byte, buf), make([]byte, buf)
	for i := range src {
		src[i] = byte(i)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("raw tcp: %w", err)
	}
	defer ln.Close()
	per := total / int64(conns) / chunk * chunk
	if per < chunk {
		per = chunk
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*conns)
	for range conns {
		wg.Go(func() {
			c, err := ln.Accept()
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			for off := int64(0); off < per; off += chunk {
				o := off % buf
				if _, err := c.Write(src[o : o+chunk]); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	clients := make([]net.Conn, conns)
	for i := range clients {
		if clients[i], err = net.Dial("tcp", ln.Addr().String()); err != nil {
			return 0, fmt.Errorf("raw tcp: %w", err)
		}
		defer clients[i].Close()
	}
	start := time.Now()
	var rg sync.WaitGroup
	for k, c := range clients {
		rg.Go(func() {
			part := dst[k*(buf/conns) : (k+1)*(buf/conns)]
			for off := int64(0); off < per; {
				n := min(int64(len(part)), per-off)
				if _, err := io.ReadFull(c, part[:n]); err != nil {
					errs <- err
					return
				}
				off += n
			}
		})
	}
	rg.Wait()
	el := time.Since(start)
	wg.Wait()
	close(errs)
	if err := errors.Join(collect(errs)...); err != nil {
		return 0, fmt.Errorf("raw tcp: %w", err)
	}
	return float64(per*int64(conns)) / el.Seconds() / 1e9, nil
}

func collect(ch chan error) []error {
	var out []error
	for e := range ch {
		out = append(out, e)
	}
	return out
}
