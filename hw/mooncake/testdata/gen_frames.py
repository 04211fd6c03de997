#!/usr/bin/env python3
"""Writes testdata/frames/*.hex: bytes a Mooncake TransferEngine (C++)
puts on the wire, derived by hand from its source, independently of the Go
encoder under test.

Sources (kvcache-ai/Mooncake, mooncake-transfer-engine):
  include/common.h            writeString: uint64 length (host order, LE on
                              x86/ARM) = payload + 1 type byte; type byte;
                              payload. OldProtocol (0xff): no type byte.
  src/transfer_metadata.cpp   encodeSegmentDesc, protocol "tcp": name,
                              protocol, tcp_data_port, tcp_proto_version,
                              timestamp, buffers[{name, addr, length}];
                              addr/length are Json::UInt64.
  src/transfer_metadata_plugin.cpp  payloads are Json::FastWriter output:
                              object keys sorted (std::map), no whitespace,
                              trailing "\n".
  src/transport/tcp_transport/tcp_transport_session_impl.h
                              SessionHeader {uint64 size; uint64 addr;
                              uint8 opcode;} = 24 bytes, 7 bytes padding
                              left uninitialised; kOpcodeV2Flag 0x80;
                              kStatusMagic 0x4D435456 << 32, OK |0,
                              AddrRejected |1, written htole64.
Run from hw/mooncake: python3 testdata/gen_frames.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(__file__), "frames")


def frame(t, payload):
    if t is None:  # OldProtocol
        return struct.pack("<Q", len(payload)) + payload
    return struct.pack("<Q", len(payload) + 1) + bytes([t]) + payload


def write(name, data, comment):
    with open(os.path.join(OUT, name + ".hex"), "w") as f:
        for line in comment.strip().splitlines():
            f.write("# " + line + "\n")
        for i in range(0, len(data), 16):
            f.write(" ".join("%02x" % b for b in data[i:i + 16]) + "\n")


# A D-side Mooncake initiator (segment "10.0.0.2:17001", one registered
# 64 MiB buffer at 0x7f8a4c000000) asking a target for its metadata.
init_seg = (b'{"buffers":[{"addr":%d,"length":67108864,' % 0x7f8a4c000000 +
            b'"name":"10.0.0.2:17001"}],"name":"10.0.0.2:17001",'
            b'"protocol":"tcp","tcp_data_port":15433,"tcp_proto_version":2,'
            b'"timestamp":"2025-06-01 12:00:00.123456"}\n')
write("metadata_request", frame(1, init_seg),
      "Metadata (1) request from a Mooncake TCP initiator, FastWriter JSON.")

# The P-side target's answer: two buffers, one above 2^53 to catch
# float64 decoding (0x7fffdeadbeef1234 is not representable in a double).
BIG = 0x7fffdeadbeef1234
assert int(float(BIG)) != BIG
tgt_seg = (b'{"buffers":[{"addr":%d,"length":1048576,' % 0x7f8d6a000000 +
           b'"name":"10.0.0.1:17000"},{"addr":%d,' % BIG +
           b'"length":4096,"name":"10.0.0.1:17000"}],'
           b'"name":"10.0.0.1:17000","protocol":"tcp","tcp_data_port":15432,'
           b'"tcp_proto_version":2,"timestamp":"2025-06-01 12:00:00.654321"}\n')
write("metadata_reply", frame(1, tgt_seg),
      "Metadata (1) reply of a Mooncake TCP target with two buffers.")

# An older target (before tcp_proto_version existed): v1 framing.
old_seg = (b'{"buffers":[],"name":"10.0.0.3:17000","protocol":"tcp",'
           b'"tcp_data_port":16000,"timestamp":"2024-12-24 08:00:00.000001"}\n')
write("metadata_reply_v1", frame(1, old_seg),
      "Metadata reply of a target without tcp_proto_version (legacy v1).")

# ENABLE_MULTI_PROTOCOL builds write "protocol" as an array and a
# per-buffer "protocol".
multi_seg = (b'{"buffers":[{"addr":%d,"length":1048576,' % 0x7f8d6a000000 +
             b'"name":"10.0.0.4:17000","protocol":"tcp"}],'
             b'"name":"10.0.0.4:17000","protocol":["tcp","hip"],'
             b'"tcp_data_port":15500,"tcp_proto_version":2,'
             b'"timestamp":"2025-06-01 12:00:00.000000"}\n')
write("metadata_reply_multiproto", frame(1, multi_seg),
      "Metadata reply of a multi-protocol (tcp+hip) build: protocol is an array.")

write("probe_request", frame(3, b'{}\n'), "Probe (3) request (sendProbe).")
write("probe_reply", frame(3, b'{"status":"success"}\n'),
      "Probe reply (receivePeerProbe).")
write("notify_request", frame(2, b'{"name":"req-42","notify_msg":"done"}\n'),
      "Notify (2) request (TransferNotifyUtil::encode).")
write("notify_reply", frame(2, b'{"name":"","notify_msg":"success"}\n'),
      "Notify reply (receivePeerNotify).")
write("connection_reply", frame(0, b'{"local_gid":"","local_lid":0,'
      b'"local_nic_path":"","payload":"","peer_nic_path":"","qp_num":[],'
      b'"reply_msg":""}\n'),
      "Connection (0) reply of a TCP-only engine: an empty HandShakeDesc.")
write("legacy_request", frame(None, b'{"local_nic_path":"a@mlx5_0",'
      b'"peer_nic_path":"b@mlx5_0","qp_num":[17]}\n'),
      "Old-protocol request: no type byte, answered as Connection.")

# Data headers. Padding bytes are whatever was on the heap: not zero.
pad = bytes([0xde, 0xad, 0xbe, 0xef, 0x00, 0x7f, 0x55])
hdr = struct.pack("<QQB", 262144, 0x7f8a4c100000, 0x80) + pad
write("header_read_v2", hdr,
      "READ v2: size 262144, addr 0x7f8a4c100000, opcode 0x80, garbage padding.")
hdr = struct.pack("<QQB", 1048576, 0x7f8a4c200000, 0x81) + bytes(7)
write("header_write_v2", hdr,
      "WRITE v2: size 1048576, addr 0x7f8a4c200000, opcode 0x81.")
hdr = struct.pack("<QQB", 4096, 0x7f8a4c300000, 0x01) + pad
write("header_write_v1", hdr,
      "WRITE v1 (MC_TCP_PROTO=1): size 4096, addr 0x7f8a4c300000, opcode 1.")
write("status_ok", struct.pack("<Q", 0x4D435456 << 32),
      "v2 status OK: kStatusMagic | 0, htole64.")
write("status_rejected", struct.pack("<Q", (0x4D435456 << 32) | 1),
      "v2 status kStatusAddrRejected: kStatusMagic | 1.")
