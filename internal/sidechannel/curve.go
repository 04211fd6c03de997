package sidechannel

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	zmq "github.com/pebbe/zmq4"
)

// Curve configures ZMQ CURVE authentication and encryption of side-channel
// and control sockets (see "Authentication" in the package doc). Keys are
// Z85 text, 40 characters (32 bytes). Give the same Curve to ServerOptions
// and ClientOptions of one worker: servers use SecretKey (and PublicKey,
// which must match it) and AuthorizedClients; clients use ServerPublicKey
// and their own key pair.
type Curve struct {
	// PublicKey and SecretKey are this worker's key pair. A server needs
	// SecretKey (PublicKey, if set, must be its public half). A client with
	// neither uses a fresh ephemeral pair (accepted only by servers that
	// admit any client).
	PublicKey, SecretKey string
	// ServerPublicKey (clients) is the public key of the servers dialled.
	ServerPublicKey string
	// AuthorizedClients (servers) lists the client public keys admitted.
	// Empty admits any client that knows the server's public key (CURVE
	// itself rejects the others).
	AuthorizedClients []string
}

// ErrBadKey: a CURVE key or key file is malformed, or a pair does not match.
var ErrBadKey = errors.New("sidechannel: bad CURVE key")

// ErrNoCurve: libzmq was built without CURVE support.
var ErrNoCurve = errors.New("sidechannel: libzmq has no CURVE support")

// String describes c without the secret key.
func (c Curve) String() string {
	sec := "unset"
	if c.SecretKey != "" {
		sec = "set"
	}
	return fmt.Sprintf("Curve{PublicKey:%q SecretKey:%s ServerPublicKey:%q AuthorizedClients:%d}",
		c.PublicKey, sec, c.ServerPublicKey, len(c.AuthorizedClients))
}

// LogValue keeps the secret key out of logs.
func (c Curve) LogValue() slog.Value { return slog.StringValue(c.String()) }

// GenerateKeyPair returns a new CURVE key pair in Z85.
func GenerateKeyPair() (public, secret string, err error) {
	if !zmq.HasCurve() {
		return "", "", ErrNoCurve
	}
	public, secret, err = zmq.NewCurveKeypair()
	if err != nil {
		return "", "", fmt.Errorf("sidechannel: generate CURVE key pair: %w", err)
	}
	return public, secret, nil
}

// z85Alphabet is ZeroMQ's Z85 alphabet (RFC 32).
const z85Alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"

// checkKey reports whether k is a 40-character Z85 key.
func checkKey(what, k string) error {
	if len(k) != 40 {
		return fmt.Errorf("%w: %s: %d characters, want 40 (Z85)", ErrBadKey, what, len(k))
	}
	for i := 0; i < len(k); i++ {
		if strings.IndexByte(z85Alphabet, k[i]) < 0 {
			return fmt.Errorf("%w: %s: character %d is not Z85", ErrBadKey, what, i)
		}
	}
	return nil
}

// KeyBytes returns the 32 raw bytes of a Z85 key (a CURVE public key as
// Client.PublicKey gives it).
func KeyBytes(z85 string) ([]byte, error) {
	if err := checkKey("key", z85); err != nil {
		return nil, err
	}
	return []byte(keyBytes(z85)), nil
}

// keyBytes returns the 32 bytes of a valid Z85 key.
func keyBytes(k string) string { return zmq.Z85decode(k) }

// checkPair checks secret and, when set, that public is its public half.
func checkPair(who, public, secret string) error {
	if err := checkKey(who+" secret key", secret); err != nil {
		return err
	}
	if public == "" {
		return nil
	}
	if err := checkKey(who+" public key", public); err != nil {
		return err
	}
	derived, err := zmq.AuthCurvePublic(secret)
	if err != nil {
		return fmt.Errorf("%w: %s: derive public key: %v", ErrBadKey, who, err)
	}
	if derived != public {
		return fmt.Errorf("%w: %s public key does not belong to its secret key", ErrBadKey, who)
	}
	return nil
}

// server checks c for a server and returns the authorized keys as raw
// 32-byte strings (nil: any client).
func (c *Curve) server() (map[string]struct{}, error) {
	if !zmq.HasCurve() {
		return nil, ErrNoCurve
	}
	if c.SecretKey == "" {
		return nil, fmt.Errorf("%w: server needs SecretKey", ErrBadKey)
	}
	if err := checkPair("server", c.PublicKey, c.SecretKey); err != nil {
		return nil, err
	}
	if len(c.AuthorizedClients) == 0 {
		return nil, nil
	}
	keys := make(map[string]struct{}, len(c.AuthorizedClients))
	for i, k := range c.AuthorizedClients {
		if err := checkKey(fmt.Sprintf("authorized client %d", i+1), k); err != nil {
			return nil, err
		}
		keys[keyBytes(k)] = struct{}{}
	}
	return keys, nil
}

// client checks c for a client and returns the keys to use (an ephemeral
// pair when c has none).
func (c *Curve) client() (*Curve, error) {
	if !zmq.HasCurve() {
		return nil, ErrNoCurve
	}
	if err := c.checkServerKey(); err != nil {
		return nil, err
	}
	out := &Curve{PublicKey: c.PublicKey, SecretKey: c.SecretKey, ServerPublicKey: c.ServerPublicKey}
	switch {
	case c.SecretKey == "" && c.PublicKey == "":
		pub, sec, err := GenerateKeyPair()
		if err != nil {
			return nil, err
		}
		out.PublicKey, out.SecretKey = pub, sec
	case c.SecretKey == "":
		return nil, fmt.Errorf("%w: client has PublicKey but no SecretKey", ErrBadKey)
	default:
		if err := checkPair("client", c.PublicKey, c.SecretKey); err != nil {
			return nil, err
		}
		if out.PublicKey == "" {
			pub, err := zmq.AuthCurvePublic(c.SecretKey)
			if err != nil {
				return nil, fmt.Errorf("%w: client: derive public key: %v", ErrBadKey, err)
			}
			out.PublicKey = pub
		}
	}
	return out, nil
}

// validate checks c for role without side effects (Options.Validate).
func (c *Curve) validate(role string) error {
	if role == roleServer {
		_, err := c.server()
		return err
	}
	if !zmq.HasCurve() {
		return ErrNoCurve
	}
	if c.SecretKey == "" && c.PublicKey == "" {
		return c.checkServerKey()
	}
	_, err := c.client()
	return err
}

func (c *Curve) checkServerKey() error {
	if c.ServerPublicKey == "" {
		return fmt.Errorf("%w: client needs ServerPublicKey", ErrBadKey)
	}
	return checkKey("server public key", c.ServerPublicKey)
}

// LoadCurveKeys reads Z85 key files; an empty path leaves its field empty.
// secretFile, publicFile and serverPublicFile hold one key each;
// authorizedFile holds one key per line. Blank lines and lines starting
// with '#' that are not keys are ignored, as is text after a key and a
// space (a comment naming the key). The pair, when both are given, must
// match; an authorized file without keys is an error (it would otherwise
// admit any client).
func LoadCurveKeys(secretFile, publicFile, serverPublicFile, authorizedFile string) (Curve, error) {
	var c Curve
	var err error
	if secretFile != "" {
		if c.SecretKey, err = readOneKey(secretFile); err != nil {
			return Curve{}, err
		}
	}
	if publicFile != "" {
		if c.PublicKey, err = readOneKey(publicFile); err != nil {
			return Curve{}, err
		}
	}
	if serverPublicFile != "" {
		if c.ServerPublicKey, err = readOneKey(serverPublicFile); err != nil {
			return Curve{}, err
		}
	}
	if authorizedFile != "" {
		keys, err := readKeys(authorizedFile)
		if err != nil {
			return Curve{}, err
		}
		if len(keys) == 0 {
			return Curve{}, fmt.Errorf("%w: %s: no keys (remove the file from the configuration to admit any client)", ErrBadKey, authorizedFile)
		}
		seen := map[string]bool{}
		for _, k := range keys {
			if !seen[k] {
				seen[k] = true
				c.AuthorizedClients = append(c.AuthorizedClients, k)
			}
		}
	}
	if c.SecretKey != "" && c.PublicKey != "" {
		if err := checkPair("this worker's", c.PublicKey, c.SecretKey); err != nil {
			return Curve{}, fmt.Errorf("%w (%s, %s)", err, secretFile, publicFile)
		}
	}
	return c, nil
}

func readOneKey(path string) (string, error) {
	keys, err := readKeys(path)
	if err != nil {
		return "", err
	}
	if len(keys) != 1 {
		return "", fmt.Errorf("%w: %s: %d keys, want 1", ErrBadKey, path, len(keys))
	}
	return keys[0], nil
}

func readKeys(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sidechannel: read key file: %w", err)
	}
	var keys []string
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		first := strings.Fields(line)[0]
		if checkKey("", first) == nil {
			keys = append(keys, first)
			continue
		}
		if strings.HasPrefix(line, "#") {
			continue
		}
		return nil, fmt.Errorf("%w: %s line %d: %v", ErrBadKey, path, n, checkKey("key", first))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("sidechannel: read key file %s: %w", path, err)
	}
	return keys, nil
}

// WriteKeyFile writes key (Z85) and a newline to a new file at path: mode
// 0600 for a secret key, 0644 otherwise. It never overwrites a file.
func WriteKeyFile(path, key string, secret bool) (err error) {
	if err := checkKey("key", key); err != nil {
		return err
	}
	mode := os.FileMode(0o644)
	if secret {
		mode = 0o600
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return fmt.Errorf("sidechannel: write key file: %w", err)
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("sidechannel: write key file: %w", cerr)
		}
		if err != nil {
			_ = os.Remove(path)
		}
	}()
	if _, err = f.WriteString(key + "\n"); err != nil {
		return fmt.Errorf("sidechannel: write key file: %w", err)
	}
	return f.Sync()
}

// WriteKeyPair generates a key pair, writes it to two new files (the secret
// one mode 0600) and returns the public key. On error neither file is left.
func WriteKeyPair(secretFile, publicFile string) (public string, err error) {
	public, secret, err := GenerateKeyPair()
	if err != nil {
		return "", err
	}
	if err := WriteKeyFile(secretFile, secret, true); err != nil {
		return "", err
	}
	if err := WriteKeyFile(publicFile, public, false); err != nil {
		_ = os.Remove(secretFile)
		return "", err
	}
	return public, nil
}
