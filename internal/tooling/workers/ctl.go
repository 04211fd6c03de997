package workers

import (
	"fmt"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/internal/decode"
)

// Client is a REQ client of one worker's control socket, used from one
// goroutine. A timed-out socket is closed and replaced.
type Client struct {
	zctx     *zmq.Context
	endpoint string
	sock     *zmq.Socket
	timeout  time.Duration
}

// Reply is a control socket's answer.
type Reply struct {
	OK            bool             `msgpack:"ok"`
	Error         string           `msgpack:"error"`
	Errors        []*string        `msgpack:"errors"`
	DoneSending   []string         `msgpack:"done_sending"`
	DoneRecving   []string         `msgpack:"done_recving"`
	FailedRecving []decode.Failure `msgpack:"failed_recving"`
	Status        map[string]any   `msgpack:"status"`
}

// NewClient is a client of endpoint; each call waits at most timeout.
func NewClient(zctx *zmq.Context, endpoint string, timeout time.Duration) *Client {
	return &Client{zctx: zctx, endpoint: endpoint, timeout: timeout}
}

// Close closes the socket (a later Call opens a new one).
func (c *Client) Close() {
	if c.sock != nil {
		c.sock.SetLinger(0)
		c.sock.Close()
		c.sock = nil
	}
}

// Call sends msg and waits for the reply; a reply that is not ok, or
// reports an error for one of its requests, is an error.
func (c *Client) Call(msg map[string]any) (Reply, error) {
	if c.sock == nil {
		s, err := c.zctx.NewSocket(zmq.REQ)
		if err != nil {
			return Reply{}, fmt.Errorf("control %s: socket: %w", c.endpoint, err)
		}
		if err := s.Connect(c.endpoint); err != nil {
			s.Close()
			return Reply{}, fmt.Errorf("control %s: connect: %w", c.endpoint, err)
		}
		c.sock = s
	}
	b, err := msgpack.Marshal(msg)
	if err != nil {
		return Reply{}, err
	}
	if _, err := c.sock.SendBytes(b, 0); err != nil {
		c.Close()
		return Reply{}, fmt.Errorf("control %s: send: %w", c.endpoint, err)
	}
	p := zmq.NewPoller()
	p.Add(c.sock, zmq.POLLIN)
	polled, err := p.Poll(c.timeout)
	if err != nil || len(polled) == 0 {
		c.Close()
		return Reply{}, fmt.Errorf("control %s: no reply within %v", c.endpoint, c.timeout)
	}
	rb, err := c.sock.RecvBytes(0)
	if err != nil {
		c.Close()
		return Reply{}, fmt.Errorf("control %s: recv: %w", c.endpoint, err)
	}
	var r Reply
	if err := msgpack.Unmarshal(rb, &r); err != nil {
		return Reply{}, fmt.Errorf("control %s: bad reply: %w", c.endpoint, err)
	}
	if !r.OK {
		return r, fmt.Errorf("control %s: %s", c.endpoint, r.Error)
	}
	for i, e := range r.Errors {
		if e != nil {
			return r, fmt.Errorf("control %s: request %d: %s", c.endpoint, i, *e)
		}
	}
	return r, nil
}
