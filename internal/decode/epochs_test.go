package decode

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// TestValidateBootEpochs: kvflow_boot_epochs is optional; present, every
// entry must be a boot epoch >= 0 (0: unknown) and there may be no more
// entries than a prefill instance has ranks. A bad one is refused at load
// naming the field, before anything is planned or read.
func TestValidateBootEpochs(t *testing.T) {
	base := func(e []int64) LoadRequest {
		return LoadRequest{RequestID: "r", LocalBlockIDs: []int{1},
			Params: KVTransferParams{RemoteBlockIDs: []int{2}, RemoteEngineID: "P", RemoteHost: "h", RemotePort: 1, BootEpochs: e}}
	}
	cases := []struct {
		name   string
		epochs []int64
		want   string // "": valid
		conv   []uint64
	}{
		{"absent (seed prefill)", nil, "", nil},
		{"empty", []int64{}, "", nil},
		{"one rank", []int64{1764870000123456789}, "", []uint64{1764870000123456789}},
		{"unknown rank", []int64{0, 7}, "", []uint64{0, 7}},
		{"negative", []int64{5, -1}, "kv_transfer_params.kvflow_boot_epochs[1]: negative boot epoch -1", nil},
		{"too many", make([]int64, MaxBootEpochs+1), "kv_transfer_params.kvflow_boot_epochs: 65536 entries, at most 65535", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := validate(base(tc.epochs))
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				if got := bootEpochs(tc.epochs); !slices.Equal(got, tc.conv) || (got == nil) != (tc.conv == nil) {
					t.Errorf("converted %v, want %v", got, tc.conv)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want ErrInvalid saying %q", err, tc.want)
			}
		})
	}
}
